"""Pool sizing (DejaVu planner) and the serving simulators that check it."""
