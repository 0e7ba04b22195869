"""A private PostgreSQL + pgvector cluster for tests and bench/index.py, from the ``pgserver`` wheel's binaries.

Its own data folder, port (127.0.0.1) and socket folder, and password authentication (scram-sha-256; a default local
cluster trusts every login, so a wrong password would pass unnoticed). PostgreSQL refuses to run as root: as root
the cluster runs as the system user ``pgserver`` (the wheel's own helper creates it), its folders made traversable.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def _pgserver():
    import warnings

    with warnings.catch_warnings():  # platformdirs warns that XDG_RUNTIME_DIR is unset, at import
        warnings.simplefilter("ignore")
        import pgserver._commands as commands
        import pgserver.utils as utils
    return commands, utils


class PgCluster:
    PASSWORD = "embedq-test-pw"

    def __init__(self, root: Path, bin_dir: Path | None = None) -> None:
        self.root = root
        self.bin_dir = bin_dir  # default: the pgserver wheel's
        self.data = root / "data"
        self.socket = root / "sock"
        self.log = root / "postgres.log"
        self.port = 0
        self.user: str | None = None

    def _run(self, args: list[str]) -> None:
        subprocess.run(args, check=True, capture_output=True, text=True, user=self.user, timeout=120)

    def start(self) -> PgCluster:
        commands, utils = _pgserver()
        bin_dir = Path(self.bin_dir or commands.POSTGRES_BIN_PATH)
        self.root.mkdir(parents=True, exist_ok=True)
        self.socket.mkdir(exist_ok=True)
        pwfile = self.root / "pwfile"
        pwfile.write_text(self.PASSWORD + "\n")
        if os.geteuid() == 0:
            import pwd
            import stat

            self.user = "pgserver"
            entry = utils.ensure_user_exists(self.user)
            utils.ensure_prefix_permissions(self.root)
            utils.ensure_prefix_permissions(bin_dir)
            utils.ensure_folder_permissions(bin_dir, stat.S_IXGRP | stat.S_IXOTH | stat.S_IRGRP | stat.S_IROTH)
            utils.ensure_folder_permissions(bin_dir.parent / "lib", stat.S_IRGRP | stat.S_IROTH)
            for path in (self.root, self.socket, pwfile):
                os.chown(path, entry.pw_uid, pwd.getpwnam(self.user).pw_gid)
        self._run([str(bin_dir / "initdb"), "-D", str(self.data), "-U", "postgres", "--encoding=utf8",
                   "--auth=scram-sha-256", f"--pwfile={pwfile}"])
        self.port = utils.find_suitable_port("127.0.0.1")
        self._run([str(bin_dir / "pg_ctl"), "-D", str(self.data), "-w", "-l", str(self.log),
                   "-o", f"-h 127.0.0.1 -p {self.port} -k {self.socket}", "start"])
        self.bin_dir = bin_dir
        return self

    def url(self, database: str = "postgres", *, password: str | None = PASSWORD, **params: str) -> str:
        auth = "postgres" + (f":{password}" if password is not None else "")
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{database}" + (f"?{query}" if query else "")

    def connect(self, database: str = "postgres"):
        import psycopg

        return psycopg.connect(self.url(database), autocommit=True)

    def create_database(self, name: str) -> str:
        with self.connect() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return name

    def stop(self) -> None:
        if self.port:
            subprocess.run([str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-w", "-m", "fast", "stop"],
                           capture_output=True, user=self.user, timeout=120)
            self.port = 0

    def __enter__(self) -> PgCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
