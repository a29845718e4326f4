# Sourced by up.sh and down.sh: is the daemon of a pid file alive?
# Alive = the pid in the file exists, is not a zombie (stopped daemons can linger as zombies in sandboxes) and
# still runs the expected program (guards against a reused pid). Never look processes up by name.
alive() {  # alive PIDFILE PROGRAM
    local pid stat
    pid="$(cat "$1" 2>/dev/null)" || return 1
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    stat="$(cat "/proc/$pid/stat" 2>/dev/null)" || return 1
    stat="${stat##*) }"                     # the state follows "(comm) ", and comm may contain spaces
    [[ "${stat%% *}" != Z ]] || return 1
    [[ "$(tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null | head -n1)" == *"$2" ]]
}
