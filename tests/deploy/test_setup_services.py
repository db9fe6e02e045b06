"""`make setup` leaves Debian's own redis-server and postgresql services off at boot when it installs
them (their postinst enables them; after a reboot Debian's redis-server held 6379 and `make up` exited 3).

The host is never touched: the real tools (systemctl, update-rc.d) work on an image directory through
DPKG_ROOT, as Debian's tools do for a system prepared from outside."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tether_testing.stack import find_repo_root

REPO = find_repo_root(Path(__file__).resolve().parent)
NO_BOOT_START = REPO / "deploy" / "local" / "no-boot-start.sh"
SETUP = REPO / "deploy" / "local" / "setup.sh"
UNIT = "lib/systemd/system/redis-server.service"
HOST_LINKS = [Path("/etc/systemd/system/multi-user.target.wants/redis-server.service"),
              *Path("/etc").glob("rc?.d/[SK][0-9][0-9]redis-server")]

pytestmark = pytest.mark.skipif(not (Path("/" + UNIT).is_file() and Path("/etc/init.d/redis-server").is_file()),
                                reason="needs Debian's redis-server package (its unit and init script)")

# What redis-server's postinst leaves: the unit enabled (and its alias), SysV start links.
POSTINST = f"""
mkdir -p "$DPKG_ROOT/lib/systemd/system" "$DPKG_ROOT/etc/systemd/system/multi-user.target.wants" \\
         "$DPKG_ROOT/etc/init.d"
cp /{UNIT} "$DPKG_ROOT/{UNIT}"
cp /etc/init.d/redis-server "$DPKG_ROOT/etc/init.d/redis-server"
ln -s /{UNIT} "$DPKG_ROOT/etc/systemd/system/multi-user.target.wants/redis-server.service"
ln -s /{UNIT} "$DPKG_ROOT/etc/systemd/system/redis.service"
for level in 2 3 4 5; do mkdir -p "$DPKG_ROOT/etc/rc$level.d"
  ln -s ../init.d/redis-server "$DPKG_ROOT/etc/rc$level.d/S01redis-server"; done
for level in 0 1 6; do mkdir -p "$DPKG_ROOT/etc/rc$level.d"
  ln -s ../init.d/redis-server "$DPKG_ROOT/etc/rc$level.d/K01redis-server"; done
"""


def _links(image: Path) -> list[str]:
    return sorted(str(p.relative_to(image)) for p in (image / "etc").rglob("*") if p.is_symlink())


def _host_links() -> dict[str, str]:
    return {str(p): os.readlink(p) for p in HOST_LINKS if p.is_symlink()}


def _enabled_redis_image(tmp_path: Path) -> Path:
    image = tmp_path / "image"
    subprocess.run(["bash", "-euc", POSTINST], env={**os.environ, "DPKG_ROOT": str(image)}, check=True)
    assert "etc/rc2.d/S01redis-server" in _links(image)
    return image


STARTS_NOTHING = [f"etc/rc{level}.d/K01redis-server" for level in range(7)]


def test_no_boot_start_turns_a_debian_service_off_at_boot(tmp_path):
    image = _enabled_redis_image(tmp_path)
    host = _host_links()
    done = subprocess.run([str(NO_BOOT_START), "redis-server"], env={**os.environ, "DPKG_ROOT": str(image)},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")
    assert _links(image) == STARTS_NOTHING  # no systemd links, SysV stop links only
    assert _host_links() == host


def test_no_boot_start_never_fails_setup(tmp_path):
    # A service that is not installed, and no tools at all on PATH: nothing to do, exit 0.
    image = tmp_path / "empty"
    image.mkdir()
    done = subprocess.run(["/bin/bash", str(NO_BOOT_START), "redis-server", "postgresql"],
                          env={"PATH": str(tmp_path / "no-tools"), "DPKG_ROOT": str(image)},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="setup.sh installs Debian packages as root (else through sudo)")
@pytest.mark.skipif(not Path("/usr/sbin/policy-rc.d").exists(),
                    reason="setup.sh would write the host's /usr/sbin/policy-rc.d for the install")
def test_setup_turns_off_the_services_of_the_packages_it_installed(tmp_path):
    """setup.sh itself, on a PATH without redis-server: apt-get (a stand-in that lays out what
    the package's postinst leaves, in the image) installs it, then the service is off at boot."""
    image = tmp_path / "image"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    apt_log = tmp_path / "apt-get.log"
    (bin_dir / "apt-get").write_text(
        "#!/bin/bash\nset -eu\n"
        f'echo "$*" >> {apt_log}\n'
        f'if [[ "$1" == install && " $* " == *" redis-server "* ]]; then\n{POSTINST}\nfi\n')
    (bin_dir / "uv").write_text('#!/bin/sh\n[ "$1" = --version ] && echo "uv 0.13.9"\nexit 0\n')
    for stub in ("apt-get", "uv"):
        (bin_dir / stub).chmod(0o755)
    tools = ["bash", "env", "python3", "bwrap", "java", "jcmd", "jfr", "mvn", "id", "tee", "chmod", "rm",
             "mkdir", "grep", "sed", "dirname", "cp", "ln", "cat", "systemctl", "update-rc.d",
             "deb-systemd-helper"]
    for tool in tools:
        found = shutil.which(tool, path="/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")  # not a pyenv shim
        assert found, f"{tool} is not installed"
        (bin_dir / tool).symlink_to(found)
    # Kafka's jars count as fetched (setup's last step), so nothing is resolved from Maven.
    state = tmp_path / "state"
    (state / "kafka" / "libs").mkdir(parents=True)
    (state / "kafka" / "libs" / "kafka.jar").write_bytes(b"")
    (state / "kafka" / "libs.sha256").write_text(
        subprocess.run(["sha256sum", str(REPO / "deploy/local/kafka/pom.xml")], capture_output=True, text=True,
                       check=True).stdout.split()[0] + "\n")
    host = _host_links()

    done = subprocess.run([str(SETUP)], env={"PATH": str(bin_dir), "HOME": str(tmp_path), "DPKG_ROOT": str(image),
                                             "TETHER_STATE_DIR": str(state)},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "install -y -q --no-install-recommends redis-server" in apt_log.read_text()
    assert "disabling Debian's own services at boot: redis-server" in done.stdout
    assert _links(image) == STARTS_NOTHING
    assert _host_links() == host
