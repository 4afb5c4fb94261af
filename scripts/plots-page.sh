#!/usr/bin/env bash
# Writes .dvc/plots/page.html: the page `dvc plots show` fills, with the Vega libraries inside it, so
# the charts draw with no network (DVC's own page loads them from a CDN). The versions are the ones
# DVC's page names (dvc_render/vega.py); run this again, with npm, after changing them.
set -euo pipefail
cd "$(dirname "$0")/.."
versions=(vega@5.20.2 vega-lite@5.2.0 vega-embed@6.18.2)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "${versions[@]}" >/dev/null)
page=.dvc/plots/page.html
mkdir -p "$(dirname "$page")"
{
  cat <<'HEAD'
<!DOCTYPE html>
<!-- The page `dvc plots show` fills with the charts, for offline use: made by scripts/plots-page.sh.
     It holds vega, vega-lite and vega-embed (BSD-3-Clause, by the Vega project), the versions
     DVC's own page loads from a CDN; it has no slot for DVC's script tags, so nothing is fetched. -->
<html>
<head>
    {refresh_tag}
    <meta charset="utf-8">
    <title>DVC Plot</title>
HEAD
  for version in "${versions[@]}"; do
    name=${version%@*}
    tar -xzf "$work/$name-${version#*@}.tgz" -C "$work" "package/build/$name.min.js"
    echo "    <!-- $version -->"
    echo "    <script>"
    cat "$work/package/build/$name.min.js"
    echo
    echo "    </script>"
  done
  cat <<'TAIL'
    <script>
        // SVG, so a chart's lines are elements a test (and a person's inspector) can read; no
        // "open in the Vega editor" link, which would send the data to a website.
        vegaEmbed = (function (embed) {
            return function (element, spec, options) {
                return embed(element, spec, Object.assign({renderer: "svg", actions: {export: true,
                    source: false, compiled: false, editor: false}}, options));
            };
        })(vegaEmbed);
    </script>
    <style>
        table {
            border-spacing: 15px;
        }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
TAIL
} > "$page.tmp"
mv "$page.tmp" "$page"
echo "wrote $page ($(wc -c < "$page") bytes)"
