"""clients.common.process_groups: what each process group holds, read from /proc."""

from __future__ import annotations

import os
import threading

from clients.common import process_groups


def test_this_process_group_is_counted():
    mine = process_groups()[os.getpgrp()]
    assert mine["processes"] >= 1
    assert mine["threads"] >= threading.active_count()
    assert mine["fds"] >= 3  # stdin, stdout, stderr at least
    assert mine["rss_kb"] > 0
