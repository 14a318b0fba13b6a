#!/usr/bin/env python3
"""Build signed apt repositories of dummy packages, for tests that cannot reach the real ones.

Usage: build_aptrepo.py SPEC.json WWW_ROOT GNUPGHOME
Prints "changed" when it (re)built the tree, "unchanged" when the spec and key were the same as last time.

SPEC is {"repositories": [...]} as molecule/resources/aptrepo.yml documents. Standard library,
dpkg-deb and gpg only (all in the node image).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from email.utils import formatdate
from pathlib import Path

KEY_UID = "budgetgpu test apt repository <aptrepo@budgetgpu.invalid>"


def run(*argv: str, env: dict[str, str] | None = None, stdout: int | None = None) -> bytes:
    result = subprocess.run(argv, check=True, env=env, stdout=stdout or subprocess.PIPE, stderr=subprocess.PIPE)
    return result.stdout or b""


def gpg_env(gnupghome: Path) -> dict[str, str]:
    gnupghome.mkdir(mode=0o700, parents=True, exist_ok=True)
    return {**os.environ, "GNUPGHOME": str(gnupghome), "LC_ALL": "C"}


def ensure_key(env: dict[str, str]) -> None:
    listed = subprocess.run(
        ["gpg", "--batch", "--list-secret-keys", KEY_UID], env=env, capture_output=True, check=False
    )
    if listed.returncode != 0:
        run(
            "gpg",
            "--batch",
            "--pinentry-mode",
            "loopback",
            "--passphrase",
            "",
            "--quick-gen-key",
            KEY_UID,
            "ed25519",
            "sign",
            "never",
            env=env,
        )


def digests(path: Path) -> dict[str, str]:
    data = path.read_bytes()
    return {"MD5Sum": hashlib.md5(data).hexdigest(), "SHA256": hashlib.sha256(data).hexdigest()}


def control_text(pkg: dict) -> str:
    fields = {
        "Package": pkg["name"],
        "Version": str(pkg["version"]),
        "Architecture": pkg.get("arch", "amd64"),
        "Maintainer": "budgetgpu tests <aptrepo@budgetgpu.invalid>",
        "Section": pkg.get("section", "misc"),
        "Priority": "optional",
    }
    for key in ("depends", "pre_depends", "provides", "conflicts", "replaces", "breaks"):
        if pkg.get(key):
            fields[key.replace("_", "-").title()] = pkg[key]
    fields["Description"] = pkg.get("description", f"dummy {pkg['name']} for budgetgpu tests")
    return "".join(f"{key}: {value}\n" for key, value in fields.items())


def build_deb(pkg: dict, dest_dir: Path) -> Path:
    version = str(pkg["version"])
    file_version = version.split(":", 1)[1] if ":" in version else version
    deb = dest_dir / f"{pkg['name']}_{file_version}_{pkg.get('arch', 'amd64')}.deb"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        (root / "DEBIAN").mkdir(parents=True)
        (root / "DEBIAN" / "control").write_text(control_text(pkg))
        files = {f"/usr/share/doc/{pkg['name']}/README.budgetgpu": "A dummy package of the budgetgpu tests.\n"}
        files.update(pkg.get("files") or {})
        for path, content in files.items():
            target = root / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
            target.chmod(0o755 if content.startswith("#!") else 0o644)
        dest_dir.mkdir(parents=True, exist_ok=True)
        run("dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root), str(deb))
    return deb


def packages_index(entries: list[tuple[dict, Path]], base: Path) -> str:
    stanzas = []
    for pkg, deb in entries:
        sums = digests(deb)
        stanzas.append(
            control_text(pkg).replace(
                "Description:",
                f"Filename: {deb.relative_to(base).as_posix()}\n"
                f"Size: {deb.stat().st_size}\nMD5sum: {sums['MD5Sum']}\n"
                f"SHA256: {sums['SHA256']}\nDescription:",
                1,
            )
        )
    return "\n".join(stanzas)


def write_index(directory: Path, text: str) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    plain = directory / "Packages"
    plain.write_text(text)
    with gzip.GzipFile(directory / "Packages.gz", "wb", mtime=0) as handle:
        handle.write(text.encode())
    return [plain, directory / "Packages.gz"]


def release_text(repo: dict, release_dir: Path, indexes: list[Path], arches: list[str]) -> str:
    lines = [
        f"Origin: {repo.get('origin', 'budgetgpu')}",
        f"Label: {repo.get('label', 'budgetgpu test repository')}",
    ]
    if repo.get("layout", "flat") == "dists":
        lines += [f"Suite: {repo['suite']}", f"Codename: {repo['suite']}", f"Components: {repo['component']}"]
    lines += [f"Architectures: {' '.join(sorted(set(arches)))}", f"Date: {formatdate(usegmt=True)}"]
    for algo in ("MD5Sum", "SHA256"):
        lines.append(f"{algo}:")
        for index in indexes:
            lines.append(f" {digests(index)[algo]} {index.stat().st_size} {index.relative_to(release_dir).as_posix()}")
    return "\n".join(lines) + "\n"


def sign(release: Path, env: dict[str, str]) -> None:
    for flag, name in (("--clearsign", "InRelease"), ("--detach-sign", "Release.gpg")):
        target = release.parent / name
        target.unlink(missing_ok=True)
        run(
            "gpg",
            "--batch",
            "--yes",
            "--armor",
            "--local-user",
            KEY_UID,
            flag,
            "--output",
            str(target),
            str(release),
            env=env,
        )


def build_repository(repo: dict, www: Path, armored_key: bytes, env: dict[str, str]) -> None:
    base = www / repo["path"].strip("/")
    base.mkdir(parents=True, exist_ok=True)
    packages = repo.get("packages") or []
    arches = [p.get("arch", "amd64") for p in packages if p.get("arch", "amd64") != "all"] or ["amd64"]
    if repo.get("layout", "flat") == "dists":
        component = repo["component"]
        entries = [(p, build_deb(p, base / "pool" / component / p["name"][0] / p["name"])) for p in packages]
        release_dir = base / "dists" / repo["suite"]
        indexes: list[Path] = []
        for arch in sorted(set(arches)):
            chosen = [(p, d) for p, d in entries if p.get("arch", "amd64") in (arch, "all")]
            indexes += write_index(release_dir / component / f"binary-{arch}", packages_index(chosen, base))
    else:
        entries = [(p, build_deb(p, base)) for p in packages]
        release_dir = base
        indexes = write_index(base, packages_index(entries, base))
    release = release_dir / "Release"
    release.write_text(release_text(repo, release_dir, indexes, arches))
    sign(release, env)
    for name in repo.get("key_files") or []:
        (base / name).write_bytes(armored_key)


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    spec_path, www, gnupghome = Path(argv[1]), Path(argv[2]), Path(argv[3])
    env = gpg_env(gnupghome)
    ensure_key(env)
    armored_key = run("gpg", "--batch", "--armor", "--export", KEY_UID, env=env)
    spec_text = spec_path.read_text()
    stamp = hashlib.sha256(spec_text.encode() + armored_key).hexdigest()
    marker = www / ".budgetgpu-aptrepo.sha256"
    if marker.exists() and marker.read_text().strip() == stamp:
        print("unchanged")
        return 0
    spec = json.loads(spec_text)
    shutil.rmtree(www, ignore_errors=True)
    (www / "keys").mkdir(parents=True, exist_ok=True)
    (www / "keys" / "aptrepo.asc").write_bytes(armored_key)
    (www / "keys" / "aptrepo.gpg").write_bytes(run("gpg", "--batch", "--export", KEY_UID, env=env))
    for repo in spec["repositories"]:
        build_repository(repo, www, armored_key, env)
    marker.write_text(stamp + "\n")
    print("changed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
