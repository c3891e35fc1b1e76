# Source me: rootful podman as it works on these machines, with its storage and
# configuration in $DEJAVU_PODMAN_DIR. crun fails here (setrlimit, cgroups in hybrid
# mode): runc with lowered ulimits; cgroupfs and a file event log (no systemd).
export DEJAVU_PODMAN_DIR=${DEJAVU_PODMAN_DIR:-/var/tmp/dejavu-podman}
mkdir -p "$DEJAVU_PODMAN_DIR"
cat > "$DEJAVU_PODMAN_DIR/storage.conf" <<CONF
[storage]
driver = "overlay"
graphroot = "$DEJAVU_PODMAN_DIR/storage"
runroot = "$DEJAVU_PODMAN_DIR/runroot"
CONF
cat > "$DEJAVU_PODMAN_DIR/containers.conf" <<CONF
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
export CONTAINERS_STORAGE_CONF="$DEJAVU_PODMAN_DIR/storage.conf"
export CONTAINERS_CONF="$DEJAVU_PODMAN_DIR/containers.conf"
