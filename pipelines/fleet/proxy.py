"""nginx's process life: found, its config checked (`nginx -t`), started in the foreground as our child (its own process
group, parent-death signal and watchdog: pipelines/serve/serving.py start_process_group), reloaded (SIGHUP), reaped
when it died, stopped. What the config says is nginx.py's; which routes it holds is the supervisor's.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from pipelines.errors import InputError, ServeError
from pipelines.fleet.nginx import ProxyLayout
from pipelines.serve.reclaim import Watchdog, exit_description
from pipelines.serve.serving import start_process_group, stop_process_group

INSTALL_HINT = "install Debian's nginx: `apt-get install nginx` (or `make setup`, which runs scripts/setup_system.sh)"
SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")
NGINX_TEST_TIMEOUT_S = 30.0
PROXY_START_TIMEOUT_S = 30.0
CONSOLE_LOG = "nginx-console.log"


class ProxyError(ServeError):
    """nginx could not be started: nothing reaches any route."""


def find_nginx(configured: str | None = None) -> Path:
    """The nginx binary: `configured` (a path), else `nginx` on PATH or in the sbin folders; an InputError saying how to install it."""
    if configured is not None:
        path = Path(configured)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise InputError(f"no nginx at {configured}; {INSTALL_HINT}", field="nginx")
    search = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
    found = shutil.which("nginx", path=search)
    if found is None:
        raise InputError(f"nginx is not installed; {INSTALL_HINT}", field="nginx")
    return Path(found)


def command(nginx: Path, layout: ProxyLayout) -> list[str]:
    """nginx in the foreground, on the run folder's prefix and config (no daemon: its master is our child)."""
    return [str(nginx), "-p", str(layout.prefix), "-c", str(layout.conf), "-e", str(layout.error_log), "-g", "daemon off;"]


def check_config(nginx: Path, layout: ProxyLayout) -> str:
    """`nginx -t` on the generated config; its verdict line, or an InputError with nginx's own complaint."""
    try:
        result = subprocess.run([*command(nginx, layout), "-t", "-q"], capture_output=True, text=True, timeout=NGINX_TEST_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise InputError(f"`nginx -t` could not run: {error}", file=layout.conf) from None
    if result.returncode != 0:
        complaint = " | ".join(line.strip() for line in result.stderr.splitlines() if line.strip())[-600:]
        raise InputError(f"`nginx -t` refused the generated config: {complaint}", file=layout.conf)
    return f"nginx -t: the configuration file {layout.conf} syntax is ok, test is successful"


def listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


class NginxProcess:
    """One nginx master on `layout`'s config, started, reloaded and stopped here; at most one runs at a time."""

    def __init__(self, nginx: Path, layout: ProxyLayout):
        self.nginx = nginx
        self.layout = layout
        self.running: tuple[subprocess.Popen, Watchdog] | None = None

    @property
    def console_log(self) -> Path:
        """nginx's own words on its console (and its watchdog's, when it stopped the group)."""
        return self.layout.prefix / CONSOLE_LOG

    @property
    def pid(self) -> int | None:
        return self.running[0].pid if self.running is not None else None

    def start(self) -> int:
        """Start nginx on the config as written and wait until it listens; its pid, or a ProxyError."""
        process, watchdog = start_process_group(command(self.nginx, self.layout), env=dict(os.environ), log_path=self.console_log)
        self.running = (process, watchdog)
        deadline = time.monotonic() + PROXY_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise ProxyError(f"nginx exited at start ({exit_description(process.returncode)}); see {self.layout.error_log}",
                                 file=self.layout.error_log)
            if listening(self.layout.listen_host, self.layout.listen_port):
                return process.pid
            time.sleep(0.1)
        raise ProxyError(f"nginx did not listen on port {self.layout.listen_port} within {PROXY_START_TIMEOUT_S:.0f} s",
                         file=self.layout.error_log)

    def check(self) -> str:
        """`nginx -t` on the config as written now."""
        return check_config(self.nginx, self.layout)

    def reload(self) -> bool:
        """SIGHUP: nginx re-reads its config (check it first); False when none runs. An nginx that died is never signalled:
        once reaped, its pid may be another process's."""
        if self.running is None or self.running[0].poll() is not None:
            return False
        self.running[0].send_signal(signal.SIGHUP)
        return True

    def exit_code(self) -> int | None:
        """The exit code of an nginx that died (reaped here), None while it runs or when none was started."""
        return self.running[0].poll() if self.running is not None else None

    def stop(self) -> None:
        running, self.running = self.running, None
        if running is not None:
            process, watchdog = running
            stop_process_group(process)
            watchdog.stop()
