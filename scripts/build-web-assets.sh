#!/usr/bin/env bash
# Rebuilds heteroserve/web/vendor/ (committed, so a clone needs no npm): pinned npm packages bundled by
# esbuild into one script, KaTeX's stylesheet with its woff2 fonts only, PDF.js's prebuilt module and worker (the
# page imports them only when a PDF is attached), and the licence of every bundled package.
# Run from anywhere: scripts/build-web-assets.sh   (needs node >= 18 and npm; the network only here, never at run time)
set -euo pipefail

PACKAGES=(markdown-it@15.0.3 dompurify@3.5.0 highlight.js@11.12.0 katex@0.19.1)
BUNDLER=esbuild@0.28.2
PDFJS=pdfjs-dist@6.5.438  # copied as built: text extraction only, so no CMaps, standard fonts or wasm decoders

VENDOR="$(cd "$(dirname "$0")/.." && pwd)/heteroserve/web/vendor"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

cd "$WORK"
npm init -y >/dev/null
npm install --no-audit --no-fund --save-exact "${PACKAGES[@]}" "$BUNDLER" "$PDFJS" >/dev/null

# The page reads the libraries from one global; highlight.js's "common" build holds ~35 languages.
cat > entry.mjs <<'JS'
import MarkdownIt from "markdown-it";
import DOMPurify from "dompurify";
import hljs from "highlight.js/lib/common";
import katex from "katex";
window.heteroserveVendor = { MarkdownIt, DOMPurify, hljs, katex };
JS
npx esbuild entry.mjs --bundle --minify --format=iife --target=es2020 --legal-comments=none \
  --metafile=meta.json --outfile=vendor.min.js --log-level=warning

rm -rf "$VENDOR"
mkdir -p "$VENDOR/fonts" "$VENDOR/licenses"
cp vendor.min.js "$VENDOR/"
# Browsers that run the page all read woff2: drop the woff and ttf fallbacks from each @font-face.
sed -E 's/,url\(fonts\/[A-Za-z0-9_-]+\.(woff|ttf)\) format\("(woff|truetype)"\)//g' \
  node_modules/katex/dist/katex.min.css > "$VENDOR/katex.min.css"
cp node_modules/katex/dist/fonts/*.woff2 "$VENDOR/fonts/"
mkdir -p "$VENDOR/pdfjs"
cp node_modules/pdfjs-dist/build/pdf.min.mjs node_modules/pdfjs-dist/build/pdf.worker.min.mjs "$VENDOR/pdfjs/"

# Every package with a file in the bundle (the metafile's inputs) brings its licence and version.
node - "$VENDOR" <<'JS'
const fs = require("fs"), path = require("path");
const vendor = process.argv[2];
const meta = JSON.parse(fs.readFileSync("meta.json", "utf8"));
const roots = new Set();
for (const input of Object.keys(meta.inputs)) {
  const m = input.match(/^(.*node_modules\/(@[^/]+\/)?[^/]+)\//);
  if (m) roots.add(m[1]);
}
const lines = [];
roots.add("node_modules/pdfjs-dist");
for (const root of [...roots].sort()) {
  const pkg = JSON.parse(fs.readFileSync(path.join(root, "package.json"), "utf8"));
  const licence = fs.readdirSync(root).find((f) => /^(licen[cs]e|copying)/i.test(f));
  if (!licence) throw new Error(`${pkg.name} has no licence file`);
  fs.copyFileSync(path.join(root, licence), path.join(vendor, "licenses", pkg.name.replace("/", "__") + ".txt"));
  lines.push(`${pkg.name}@${pkg.version} ${pkg.license}`);
}
fs.writeFileSync(path.join(vendor, "VERSIONS.txt"),
  "Bundled into vendor.min.js by scripts/build-web-assets.sh (katex.min.css and fonts/ are KaTeX's, " +
  "pdfjs/ is pdfjs-dist's build/):\n" + lines.join("\n") + "\n");
JS
du -sh "$VENDOR"
