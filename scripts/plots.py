#!/usr/bin/env python
"""`make plots`: dvc.yaml's plots as one HTML page that renders offline.

    python scripts/plots.py [-o reports/plots] [-- <more `dvc plots show` arguments>]

`dvc plots show` writes a page whose <script> tags load Vega, Vega-Lite and Vega-Embed from a CDN, so on a machine
without internet (common on clusters) the page is blank. This writes an HTML template (`dvc plots show
--html-template`) with those three libraries inlined, bundled offline by vl-convert-python (pinned in
requirements.txt; it embeds the Vega packages from npm), then runs `dvc plots show` with it: the page
(reports/plots/index.html, ~1 MB) needs no network.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

# DVC's plot specs are Vega-Lite v5 (its CDN page loads vega-lite@5); the bundle provides the globals DVC's
# <div> scripts call (`vegaEmbed('#id', spec)`).
VEGA_LITE = "5.21"
EXPOSE = "window.vegaEmbed = vegaEmbed; window.vega = vega; window.vegaLite = vegaLite;"
PAGE = """<!DOCTYPE html>
<html>
<head>
<meta charset="utf-8">
<title>agentrl: DVC plots</title>
<!-- Vega, Vega-Lite {vega_lite} and Vega-Embed inlined by scripts/plots.py (vl-convert-python): no network needed -->
<script type="text/javascript">
(function () {{
{bundle}
}})();
</script>
</head>
<body>
{{plot_divs}}
</body>
</html>
"""


def offline_template(vega_lite: str = VEGA_LITE) -> str:
    """An HTML template for `dvc plots show --html-template` with the Vega libraries inlined (no CDN)."""
    import vl_convert

    bundle = vl_convert.javascript_bundle(EXPOSE, vl_version=vega_lite)
    if "{plot_divs}" in bundle or "{scripts}" in bundle:  # dvc_render fills placeholders by str.replace
        raise RuntimeError("the Vega bundle contains a dvc_render placeholder; it cannot be inlined as is")
    return PAGE.format(vega_lite=vega_lite, bundle=bundle)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--out", default="reports/plots", help="output folder (default: reports/plots)")
    ap.add_argument("dvc_args", nargs="*", help="more `dvc plots show` arguments (after --)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    template = out / "offline-template.html"
    template.write_text(offline_template(), encoding="utf-8")
    exe = Path(sys.executable).parent / "dvc"
    cmd = [str(exe) if exe.is_file() else "dvc", "plots", "show", "--html-template", str(template), "-o", str(out)]
    print("+", " ".join(cmd[1:] + a.dvc_args), flush=True)
    r = subprocess.run(cmd + a.dvc_args)
    if r.returncode == 0:
        print(f"wrote {out / 'index.html'} (renders offline)")
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
