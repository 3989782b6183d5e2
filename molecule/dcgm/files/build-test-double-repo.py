#!/usr/bin/python3
"""Build a signed, flat apt repository (the layout of NVIDIA's CUDA repository) holding a TEST DOUBLE
of datacenter-gpu-manager, for the dcgm role's Molecule scenario.

Usage: build-test-double-repo.py SOURCE_DIR REPO_DIR VERSION
Writes REPO_DIR/{*.deb, Packages, Release, InRelease, key.asc}; the key is a throwaway one.
"""

import email.utils
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

src, repo, version = sys.argv[1:4]
os.makedirs(repo, exist_ok=True)
with tempfile.TemporaryDirectory() as tmp:
    root = os.path.join(tmp, "pkg")
    for d in ("DEBIAN", "usr/bin", "lib/systemd/system"):
        os.makedirs(os.path.join(root, d))
    shutil.copy(os.path.join(src, "nv-hostengine"), os.path.join(root, "usr/bin/nv-hostengine"))
    shutil.copy(os.path.join(src, "dcgmi"), os.path.join(root, "usr/bin/dcgmi"))
    shutil.copy(os.path.join(src, "nvidia-dcgm.service"), os.path.join(root, "lib/systemd/system/nvidia-dcgm.service"))
    for f in ("usr/bin/nv-hostengine", "usr/bin/dcgmi"):
        os.chmod(os.path.join(root, f), 0o755)  # noqa: S103 - programs in /usr/bin are world-executable
    with open(os.path.join(root, "DEBIAN/control"), "w") as fh:
        fh.write(
            "Package: datacenter-gpu-manager\n"
            f"Version: {version}\n"
            "Architecture: all\n"
            "Maintainer: fleetheal tests <tests@fleetheal.invalid>\n"
            "Depends: python3\n"
            "Description: TEST DOUBLE of NVIDIA DCGM for fleetheal's Molecule tests\n"
            " Not NVIDIA software: nv-hostengine only listens on its port; dcgmi reports no GPU.\n"
        )
    deb_name = f"datacenter-gpu-manager_{version.split(':')[-1]}_all.deb"
    deb = os.path.join(repo, deb_name)
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", root, deb], check=True, stdout=subprocess.DEVNULL)
    control = subprocess.run(["dpkg-deb", "-f", deb], check=True, capture_output=True, text=True).stdout
    with open(deb, "rb") as fh:
        data = fh.read()
    stanza = control.rstrip("\n").split("\nDescription:")[0]
    desc = "Description:" + control.rstrip("\n").split("\nDescription:")[1]
    packages = (
        f"{stanza}\nFilename: ./{deb_name}\nSize: {len(data)}\n"
        f"MD5sum: {hashlib.md5(data, usedforsecurity=False).hexdigest()}\n"
        f"SHA256: {hashlib.sha256(data).hexdigest()}\n{desc}\n"
    )
    with open(os.path.join(repo, "Packages"), "w") as fh:
        fh.write(packages)
    pk = packages.encode()
    release = (
        "Origin: fleetheal-test-double\nLabel: fleetheal-test-double\n"
        f"Date: {email.utils.formatdate(usegmt=True)}\nArchitectures: all amd64\n"
        f"MD5Sum:\n {hashlib.md5(pk, usedforsecurity=False).hexdigest()} {len(pk)} Packages\n"
        f"SHA256:\n {hashlib.sha256(pk).hexdigest()} {len(pk)} Packages\n"
    )
    with open(os.path.join(repo, "Release"), "w") as fh:
        fh.write(release)
    gnupg = os.path.join(tmp, "gnupg")
    os.makedirs(gnupg, mode=0o700)
    gpg = ["gpg", "--homedir", gnupg, "--batch", "--quiet", "--pinentry-mode", "loopback", "--passphrase", ""]
    subprocess.run([*gpg, "--quick-generate-key", "fleetheal test double repo", "ed25519", "sign", "1d"], check=True)
    release_path, inrelease = os.path.join(repo, "Release"), os.path.join(repo, "InRelease")
    subprocess.run([*gpg, "--yes", "--clearsign", "-o", inrelease, release_path], check=True)
    subprocess.run([*gpg, "--yes", "--armor", "--export", "-o", os.path.join(repo, "key.asc")], check=True)
print(f"built {deb} and a signed flat repository in {repo}")
