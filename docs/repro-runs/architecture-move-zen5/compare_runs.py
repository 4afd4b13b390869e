"""Compare two workspaces' dvc.lock outs (same CPU, before/after a code move): per out, identical or not; for a
differing directory, which files differ; for a differing JSON file, which keys differ."""

import json
import sys
from pathlib import Path

import yaml

a_root, b_root = Path(sys.argv[1]), Path(sys.argv[2])
a = yaml.safe_load((a_root / "dvc.lock").read_text())["stages"]
b = yaml.safe_load((b_root / "dvc.lock").read_text())["stages"]


def dir_listing(root, md5):
    p = root / ".dvc/cache/files/md5" / md5[:2] / md5[2:]
    return {e["relpath"]: e["md5"] for e in json.loads(p.read_text())}


def json_diff(x, y, prefix=""):
    out = []
    if isinstance(x, dict) and isinstance(y, dict):
        for k in sorted(set(x) | set(y)):
            out += json_diff(x.get(k), y.get(k), f"{prefix}.{k}" if prefix else k)
    elif x != y:
        out.append(prefix)
    return out


same = differ = 0
for stage, entry in a.items():
    for out in entry.get("outs", []):
        path, md5 = out["path"], out["md5"]
        other = next(o for o in b[stage]["outs"] if o["path"] == path)["md5"]
        if md5 == other:
            same += 1
            continue
        differ += 1
        if md5.endswith(".dir"):
            la, lb = dir_listing(a_root, md5), dir_listing(b_root, other)
            files = sorted(f for f in set(la) | set(lb) if la.get(f) != lb.get(f))
            print(f"DIFF {path}: files {files}")
        elif path.endswith(".json"):
            keys = json_diff(json.loads((a_root / path).read_text()), json.loads((b_root / path).read_text()))
            print(f"DIFF {path}: keys {keys}")
        else:
            print(f"DIFF {path}")
print(f"{same} outs identical, {differ} differ")
