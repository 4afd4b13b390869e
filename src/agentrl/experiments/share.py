"""`make push` / `make pull`: share the pipeline's results through a DVC remote.

The DVC-cached outputs (data/prepared, models/*, eval/*, dvclive/*, models/card) go to the DVC remote;
the metrics files (`cache: false`), dvc.lock and params.yaml travel with git. A colleague who clones the
repository and runs `make pull` gets the exact models and outputs of the pushed commit: `dvc status` is
clean and `dvc repro` runs no stage. checkpoints/ is not a DVC output and is never shared.

Remote: the default remote of .dvc/config (`local` -> ~/.cache/agentrl/dvc-remote), or the one-off
DVC_REMOTE (a directory or a URL such as s3://bucket/agentrl, gs://..., ssh://host/path; those need
`make setup EXTRAS=s3|gs|ssh`). DVC_REMOTE is applied for this command only, never written to a config file.

Experiments: where the git remote GIT_REMOTE (default origin) exists, push/pull also run
`dvc exp push/pull <git remote>` for the experiments of the current commit (their git refs to the git
remote, their cached outputs to the same DVC remote). Without a git remote they are skipped, with a line
saying so.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REMOTE_ENV = "DVC_REMOTE"
GIT_REMOTE_ENV = "GIT_REMOTE"
OVERRIDE = "cli"  # the name the one-off DVC_REMOTE gets inside this process


class ShareError(RuntimeError):
    """A shared DVC remote that cannot be read or written; said in one line."""

    pass


def remote_override(url: Optional[str]) -> Optional[dict]:
    """DVC config merged over the repository's for this process: DVC_REMOTE becomes the default remote."""
    if not url:
        return None
    if not re.match(r"^[A-Za-z][\w+.-]*://", url):  # a local directory
        url = str(Path(url).expanduser().resolve())
    return {"remote": {OVERRIDE: {"url": url}}, "core": {"remote": OVERRIDE}}


def open_repo(url: Optional[str], verify: bool = False):
    """(repo, remote name, remote url) with DVC_REMOTE as the default remote when given. `verify`: DVC's remote
    option `verify` for this process, so a download is hashed and an object whose content does not match its
    name (a corrupted remote) is refused instead of installed."""
    from dvc.repo import Repo

    override = remote_override(url)
    repo = Repo(".", config=override)
    name = repo.config["core"].get("remote")
    if not name:
        raise ShareError(
            f"no DVC remote: .dvc/config names no default remote; set {REMOTE_ENV}=<directory or URL> "
            "(README: Sharing results)"
        )
    if name not in repo.config["remote"]:
        raise ShareError(f"the default DVC remote {name!r} is not defined in .dvc/config")
    if verify:
        repo.close()
        conf = override or {}
        conf = {
            **conf,
            "remote": {**conf.get("remote", {}), name: {**conf.get("remote", {}).get(name, {}), "verify": True}},
        }
        repo = Repo(".", config=conf)
    return repo, name, repo.config["remote"][name]["url"]


def check_remote_exists(repo, name: str, where: str) -> None:
    """A remote that does not exist (a mistyped directory, an empty bucket path) is an error naming it, not
    DVC's 'Is your cache up to date?'."""
    remote = repo.cloud.get_remote(name)
    if not remote.fs.exists(remote.path):
        raise ShareError(
            f"the DVC remote {name!r} ({where}) does not exist: nothing was pushed there. Check "
            f"{REMOTE_ENV} / .dvc/config, or run `make push` where the results are"
        )


def git_remote_url(name: str) -> Optional[str]:
    """The URL of a git remote, or None when it is not set."""
    r = subprocess.run(["git", "remote", "get-url", name], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def uncommitted_results() -> list[str]:
    """dvc.lock, params.yaml, dvc.yaml, metrics/ and diagnostics/ differing from git HEAD: a clone would not get
    them."""
    r = subprocess.run(
        ["git", "status", "--porcelain", "--", "dvc.lock", "dvc.yaml", "params.yaml", "metrics", "diagnostics"],
        capture_output=True,
        text=True,
    )
    return [line[3:] for line in r.stdout.splitlines() if line.strip()]


class _MissingCache(logging.Handler):
    """DVC only warns when an output of dvc.lock is in neither the local cache nor the remote, and pushes the
    rest; a push that leaves the remote without an output a clone needs is an error here."""

    MARK = "do not exist neither locally nor on remote"

    def __init__(self):
        super().__init__(logging.WARNING)
        self.missing: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if self.MARK in msg:
            self.missing += [line for line in msg.splitlines()[1:] if line.strip()]


def push(url: Optional[str], git_remote: str) -> dict:
    """The workspace's DVC outputs pushed to the shared remote; returns what was sent and how long it took."""
    repo, name, where = open_repo(url)
    with repo:
        t = time.perf_counter()
        watch = _MissingCache()
        dvc_log = logging.getLogger()  # dvc_data.index.fetch (a logger outside "dvc") emits it
        dvc_log.addHandler(watch)
        try:
            pushed = repo.push()
        finally:
            dvc_log.removeHandler(watch)
        if watch.missing:
            raise ShareError(
                f"{len(watch.missing)} cached outputs of dvc.lock are in neither the local cache nor remote "
                f"{name!r} ({where}), so a clone could not pull them; run `dvc repro` (or `dvc pull` from "
                f"the remote that has them) before pushing: {'; '.join(watch.missing[:5])}"
            )
        out = {"remote": name, "url": where, "pushed": pushed, "seconds": round(time.perf_counter() - t, 2)}
        print(f"dvc push: {pushed} files to remote {name!r} ({where}) in {out['seconds']} s")
        pending = uncommitted_results()
        if pending:
            print(
                f"note: {', '.join(pending)} differ from the git commit; commit them (git) so that a clone pulls "
                "these versions",
                file=sys.stderr,
            )
        out["experiments"] = _experiments(repo, "push", git_remote)
    return out


class _Corrupt(logging.Filter):
    """DVC (remote option `verify`) hashes each object it downloads and drops one whose content does not match
    its name, logging `corrupted cache file '<path>'` at debug level (dvc_data.hashfile.db); collected here to
    name the files. Records below the logger's former level are dropped after reading, as before."""

    MARK = re.compile(r"corrupted cache file '([^']+)'")
    LOGGER = "dvc_data.hashfile.db"

    def __init__(self):
        super().__init__()
        self.paths: list[str] = []

    def __enter__(self):
        self.log = logging.getLogger(self.LOGGER)
        self.level, self.quiet_below = self.log.level, self.log.getEffectiveLevel()
        self.log.setLevel(logging.DEBUG)
        self.log.addFilter(self)
        return self

    def __exit__(self, *exc):
        self.log.removeFilter(self)
        self.log.setLevel(self.level)

    def filter(self, record):
        m = self.MARK.search(record.getMessage())
        if m:
            self.paths.append(m.group(1))
        return record.levelno >= self.quiet_below


def _objects(repo) -> dict[str, str]:
    """{md5 of a cached object: the workspace path it is}, for every output of the pipeline and the files
    inside directory outputs (from their .dir manifests in the local cache, when present)."""
    import json

    out: dict[str, str] = {}
    for o in repo.index.outs:
        if not o.hash_info or not o.hash_info.value:
            continue
        value, path = o.hash_info.value, os.path.relpath(o.fs_path, repo.root_dir)
        out[value.removesuffix(".dir")] = path + (" (its .dir listing)" if value.endswith(".dir") else "")
        if value.endswith(".dir"):
            manifest = Path(repo.cache.local.path) / value[:2] / value[2:]
            try:
                entries = json.loads(manifest.read_text())
            except (OSError, ValueError):
                continue
            for e in entries:
                out[e["md5"]] = f"{path}/{e['relpath']}"
    return out


def _corrupt_names(repo, paths: list[str]) -> list[str]:
    known = _objects(repo)
    names = []
    for p in paths:
        parts = Path(p).parts
        md5 = (parts[-2] + parts[-1]).removesuffix(".dir") if len(parts) >= 2 else p
        names.append(f"{known.get(md5, p)} (md5 {md5})")
    return names


def pull(url: Optional[str], git_remote: str) -> dict:
    """`dvc pull` with the remote's `verify` on: every downloaded object is hashed, and a file whose content
    does not match dvc.lock fails the pull naming it (it is not installed); a remote that does not exist and
    outputs missing from it are named as such."""
    from dvc.exceptions import DvcException

    repo, name, where = open_repo(url, verify=True)
    with repo:
        check_remote_exists(repo, name, where)
        t = time.perf_counter()
        missing = _MissingCache()
        root_log = logging.getLogger()  # dvc_data.index.fetch (a logger outside "dvc") warns of missing files
        root_log.addHandler(missing)
        error = None
        try:
            with _Corrupt() as corrupt:
                try:
                    stats = repo.pull()["stats"]
                    out = {
                        "remote": name,
                        "url": where,
                        "fetched": stats.get("fetched", 0),
                        "seconds": round(time.perf_counter() - t, 2),
                    }
                    print(f"dvc pull: {out['fetched']} files from remote {name!r} ({where}) in {out['seconds']} s")
                    out["experiments"] = _experiments(repo, "pull", git_remote)
                except DvcException as e:
                    error = e
        finally:
            root_log.removeHandler(missing)
        if corrupt.paths:
            raise ShareError(
                f"{len(corrupt.paths)} files from remote {name!r} ({where}) do not match their hashes in dvc.lock "
                "(the remote's copy is corrupt) and were not installed: "
                + "; ".join(_corrupt_names(repo, corrupt.paths)[:10])
            )
        if missing.missing:
            raise ShareError(
                f"{len(missing.missing)} outputs of dvc.lock are not on remote {name!r} ({where}): "
                f"{'; '.join(missing.missing[:10])}; push them from where the results are (make push)"
            )
        if error is not None:
            raise error
    return out


def _experiments(repo, action: str, git_remote: str):
    if git_remote_url(git_remote) is None:
        print(f"dvc exp {action}: skipped, no git remote {git_remote!r} ({GIT_REMOTE_ENV}=<name> to choose one)")
        return None
    if action == "push":
        result = repo.experiments.push(git_remote, push_cache=True)
    else:
        result = repo.experiments.pull(git_remote, pull_cache=True)
    result = result if isinstance(result, dict) else {"pulled": list(result or [])}
    print(f"dvc exp {action} {git_remote}: {result}")
    return result


def main() -> None:
    """`python -m agentrl.experiments.share push|pull` (`make push`, `make pull`)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("push", "pull"))
    ap.add_argument(
        "--remote",
        default=os.environ.get(REMOTE_ENV) or None,
        help=f"DVC remote directory or URL for this command (default: ${REMOTE_ENV}, else .dvc/config)",
    )
    ap.add_argument("--git-remote", default=os.environ.get(GIT_REMOTE_ENV) or "origin")
    a = ap.parse_args()
    from dvc.exceptions import DvcException

    try:
        (push if a.action == "push" else pull)(a.remote, a.git_remote)
    except (ShareError, DvcException) as e:
        print(f"make {a.action}: {e}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
