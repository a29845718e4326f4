"""``kdsweep dashboard <sweep dir>``: serve the sweep's study with optuna-dashboard (imported here only).

The storage comes from the sweep's manifest, which keeps a database URL without its password; a password comes
from the environment (KDSWEEP_STORAGE_URL, the full URL), as it does for the sweep's jobs.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from kdsweep.config.schema import ConfigError
from kdsweep.sweep.manifest import STORAGE_ENV, Manifest, connect_url
from kdsweep.sweep.study import make_storage, redact, storage_url


def _check_port(host: str, port: int) -> None:
    """One clear line now, rather than a traceback from the web server after the URL was printed."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: cannot be resolved ({e.strerror})") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does: only a live listener conflicts
        try:
            s.bind(address)
        except OSError as e:
            fix = "pick another --port" if e.errno == errno.EADDRINUSE else "check --host"
            raise ConfigError(f"cannot serve on {host}:{port} ({e.strerror}); {fix}") from None


def serve(sweep_dir: Path, host: str = "127.0.0.1", port: int = 8080) -> None:
    """Print the dashboard's URLs, then serve until interrupted."""
    if not 0 < port < 65536:
        raise ConfigError(f"--port {port} must be in 1..65535")
    manifest = Manifest.load(sweep_dir)
    settings = manifest.settings
    env, saved = os.environ.get(STORAGE_ENV), storage_url(settings, sweep_dir)
    if env and redact(env) != saved:  # a URL left in the environment by another sweep: say so, not ignore it
        raise ConfigError(
            f"{STORAGE_ENV}={redact(env)} is not the storage of {sweep_dir} ({saved}); unset it, or set it to "
            "that URL with its password"
        )
    url = connect_url(settings, sweep_dir)
    storage = make_storage(url)
    try:
        study_id = storage.get_study_id_from_name(settings.study_name)
    except KeyError:
        raise ConfigError(f"study {settings.study_name!r} is not in {redact(url)} (has the sweep started?)") from None
    _check_port(host, port)

    import optuna_dashboard

    base = f"http://{host}:{port}/dashboard/"
    print(f"{base}  (study {settings.study_name}: {base}studies/{study_id}; Ctrl-C stops)", flush=True)
    optuna_dashboard.run_server(storage, host=host, port=port)
