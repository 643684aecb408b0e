#!/usr/bin/env python3
"""Re-vendors the web page's third-party libraries from the npm registry.

    python3 crates/gateway/web/vendor/update.py [marked@X.Y.Z] [dompurify@X.Y.Z]

Each package is fetched with `npm pack` (which checks the registry's
integrity hash), the files listed below are copied byte for byte, and
vendor.json records the version, the tarball's integrity and each file's
SHA-256. A test of keel-gateway checks the committed files against
vendor.json, so an edited or half-updated file fails CI.
"""

import hashlib
import json
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile

HERE = pathlib.Path(__file__).resolve().parent

# package -> [(path inside the tarball, file name here)]; upstream's own
# minified ES module / UMD builds, so no build step of ours is involved.
FILES = {
    "marked": [
        ("package/lib/marked.esm.js", "marked.esm.js"),
        ("package/LICENSE", "LICENSE-marked.txt"),
    ],
    "dompurify": [
        ("package/dist/purify.min.js", "purify.min.js"),
        ("package/LICENSE", "LICENSE-dompurify.txt"),
    ],
}


def current_versions():
    manifest = json.loads((HERE / "vendor.json").read_text())
    return {p["name"]: p["version"] for p in manifest["packages"]}


def main(argv):
    wanted = current_versions() if (HERE / "vendor.json").exists() else {}
    for spec in argv:
        name, _, version = spec.partition("@")
        if name not in FILES or not version:
            sys.exit(f"update.py: expected NAME@VERSION with NAME in {sorted(FILES)}, got {spec!r}")
        wanted[name] = version
    missing = [n for n in FILES if n not in wanted]
    if missing:
        sys.exit(f"update.py: no version known for {missing}; pass NAME@VERSION")
    packages = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted(FILES):
            version = wanted[name]
            out = subprocess.run(
                ["npm", "pack", "--json", f"{name}@{version}"],
                cwd=tmp, check=True, capture_output=True, text=True,
            )
            info = json.loads(out.stdout)[0]
            files = []
            with tarfile.open(pathlib.Path(tmp) / info["filename"]) as tar:
                for inner, target in FILES[name]:
                    data = tar.extractfile(inner).read()
                    (HERE / target).write_bytes(data)
                    files.append({
                        "from": inner,
                        "file": target,
                        "sha256": hashlib.sha256(data).hexdigest(),
                    })
            packages.append({
                "name": name,
                "version": info["version"],
                "integrity": info["integrity"],
                "files": files,
            })
    manifest = {
        "about": "Third-party files of keel's web page, copied byte for byte from "
                 "their npm packages by update.py; a keel-gateway test checks them.",
        "packages": packages,
    }
    (HERE / "vendor.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for p in packages:
        print(f"vendored {p['name']}@{p['version']}")


if __name__ == "__main__":
    main(sys.argv[1:])
