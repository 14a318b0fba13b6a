"""Driver-domain checks that the nvidia_driver role lists in its one input check."""

from __future__ import annotations

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.driver import (
    cuda_input_problems,
    cuda_major,
    driver_input_problems,
    installed_branches,
    module_flavor_decision,
    module_options_problems,
)

GTX_1080_TI = {"bus_id": "0000:03:00.0", "device_id": "0x1b06"}
RTX_5090 = {"bus_id": "0000:04:00.0", "device_id": "0x2b85"}


def test_flavor_decision_returns_the_problem_instead_of_failing():
    decision = module_flavor_decision("open", [GTX_1080_TI], None, 550, "node1")
    assert decision["flavor"] == ""
    assert decision["problem"].startswith("node1: nvidia_driver_kernel_modules is 'open' but 0000:03:00.0")
    assert module_flavor_decision("auto", [GTX_1080_TI, RTX_5090], None, 550, "node1")["problem"].endswith(
        "move one kind of GPU to another node"
    )
    assert module_flavor_decision("auto", [], None, 580) == {"flavor": "open", "problem": ""}
    assert module_flavor_decision("auto", [], None, 550) == {"flavor": "proprietary", "problem": ""}


def test_cuda_major_of_a_version_a_package_version_and_a_number():
    assert cuda_major("12.4") == 12
    assert cuda_major("11.8.89~11.8.0-5~deb12u1") == 11
    assert cuda_major(12) == 12
    assert cuda_major(None) is None


def test_module_options_problems_name_host_variable_and_entry():
    assert module_options_problems({"nvidia": {"NVreg_PreserveVideoMemoryAllocations": 1}}, "node1") == []
    problems = module_options_problems({"nvidia": "NVreg_X=1", "Bad-Name": {}, "nvidia_drm": {"bad-opt": 1}}, "node1")
    assert [problem.split(" must ", maxsplit=1)[0] for problem in problems] == [
        "node1: nvidia_driver_module_options['nvidia']",
        "node1: nvidia_driver_module_options['Bad-Name']",
        "node1: nvidia_driver_module_options['nvidia_drm']",
    ]
    assert module_options_problems("nvidia=1", "node1") == [
        "node1: nvidia_driver_module_options is str, expected a mapping"
    ]


GOOD = {
    "host": "node1",
    "distribution": "Debian",
    "version": "12.7",
    "major_version": "12",
    "supported_versions": ["12", "13"],
    "source_asked": "auto",
    "source": "debian",
    "supported_sources": ["debian", "nvidia_repo"],
    "branch_asked": None,
    "branch": 535,
    "debian_branch": 535,
    "ubuntu_server": False,
    "module_options": {},
    "flavor_problem": None,
    "secure_boot_on": False,
    "secure_boot": "refuse",
    "mok_key": "/var/lib/dkms/mok.key",
    "mok_cert": "/var/lib/dkms/mok.pub",
    "mok_missing": True,
    "installed_branches": [],
    "allow_branch_change": False,
}


def test_installed_branches_are_the_driver_packages_branches_once_each():
    packages = {
        "nvidia-driver": [{"version": "535.216.01-1~deb12u1"}],
        "libnvidia-compute-550": [{"version": "550.127.05-0ubuntu1"}, {"version": "1:535.183.01-1"}],
        "cuda-drivers": [{"version": "550.127.08-1"}],
        # Versions of their own, and packages that only look alike.
        "nvidia-modprobe": [{"version": "570.133.07-1"}],
        "xserver-xorg-video-nvidia": [{"version": "560.35.03-1"}],
        "nvidia-cuda-toolkit": [{"version": "12.0.140~12.0.1-4"}],
    }
    assert installed_branches(packages, ["nvidia-modprobe"]) == [535, 550]
    assert installed_branches(None) == []


def test_driver_inputs_that_fit_give_no_problem():
    assert driver_input_problems(GOOD) == []
    assert driver_input_problems({**GOOD, "installed_branches": [535]}) == []
    assert driver_input_problems({**GOOD, "secure_boot_on": True, "secure_boot": "unsigned"}) == []


def test_an_unsupported_os_is_the_only_problem_and_its_other_inputs_are_not_read():
    assert driver_input_problems(
        {"host": "n", "distribution": "Fedora", "version": "40", "supported_versions": []}
    ) == ["n: runs Fedora 40; budgetgpu.cluster.nvidia_driver supports Ubuntu 22.04/24.04 and Debian 12/13"]
    assert driver_input_problems({**GOOD, "version": "11.9", "source": "bogus", "branch": "x"}) == [
        "node1: runs Debian 11.9; budgetgpu.cluster.nvidia_driver supports Debian 12, 13"
    ]
    # 120.04 is not 12: the version must match a supported one up to a dot.
    assert driver_input_problems({**GOOD, "version": "120.04"})[0].startswith("node1: runs Debian 120.04;")


def test_every_problem_of_a_tired_persons_inputs_is_named_in_order():
    bad = {
        **GOOD,
        "source_asked": "ubunut",
        "source": "ubunut",
        "branch_asked": "55",
        "branch": "55",
        "ubuntu_server": True,
        "module_options": {"nvidia": "NVreg_X=1"},
        "flavor_problem": "node1: nvidia_driver_kernel_modules is open but GPU 0 is a Pascal card",
        "secure_boot_on": True,
        "installed_branches": [535],
    }
    problems = driver_input_problems(bad)
    assert [p.split(": ", 2)[1].split(" ")[0] for p in problems] == [
        "nvidia_driver_source",
        "nvidia_driver_branch",
        "nvidia_driver_ubuntu_server",
        "nvidia_driver_module_options['nvidia']",
        "nvidia_driver_kernel_modules",
        "Secure",
        "driver",
    ]
    assert all(p.startswith("node1: ") for p in problems)
    assert "use one of auto, debian, nvidia_repo" in problems[0]
    assert "'55' (source ubunut on Debian 12.7): expected a driver branch number such as 550" in problems[1]
    assert "driver branch 535 is installed and nvidia_driver_branch asks for 55" in problems[-1]


def test_debian_archive_ships_one_branch_and_mok_signing_needs_its_key():
    problems = driver_input_problems({**GOOD, "branch": 550})
    assert problems == [
        "node1: nvidia_driver_branch is 550 but Debian 12's non-free archive ships branch 535: leave "
        "nvidia_driver_branch unset, or set nvidia_driver_source to nvidia_repo for another branch"
    ]
    mok = driver_input_problems({**GOOD, "secure_boot_on": True, "secure_boot": "mok_signed"})
    assert mok == [
        "node1: nvidia_driver_secure_boot is mok_signed but /var/lib/dkms/mok.key or /var/lib/dkms/mok.pub is "
        "missing: create them (dkms generate_mok), enroll the certificate (mokutil --import /var/lib/dkms/mok.pub, "
        "confirm at the console on the next boot), then run again"
    ]
    assert (
        driver_input_problems({**GOOD, "secure_boot_on": True, "secure_boot": "mok_signed", "mok_missing": False}) == []
    )
    assert driver_input_problems({**GOOD, "installed_branches": [470], "allow_branch_change": True}) == []


CUDA = {
    "host": "node1",
    "distribution": "Debian",
    "version": "12.7",
    "cuda_version": "12.4",
    "nccl_install": True,
    "nccl_version": "auto",
    "nccl_version_pattern": r"^[0-9]+\.[0-9]+\.[0-9]+-[0-9]+\+cuda[0-9]+(\.[0-9]+)?$",
    "variant_problem": "",
    "nccl_problem": "",
    "toolkit_install": False,
    "driver_cuda": "12.4",
    "driver_version": "550.54.14",
}


def test_cuda_inputs_that_fit_have_no_problem():
    assert cuda_input_problems(CUDA) == []
    assert cuda_input_problems({**CUDA, "nccl_version": "2.21.5-1+cuda12.4", "driver_cuda": None}) == []


def test_cuda_nccl_problems_come_one_at_a_time_format_first():
    bad_version = {**CUDA, "nccl_version": "2.21", "variant_problem": "no CUDA", "nccl_problem": "node1: other"}
    assert cuda_input_problems(bad_version) == [
        "node1: cuda_nccl_version is '2.21': expected auto or NVIDIA's package version such as 2.21.5-1+cuda12.4"
    ]
    assert cuda_input_problems({**CUDA, "variant_problem": "no CUDA"}) == ["node1: cuda_torch_variant auto: no CUDA"]
    assert cuda_input_problems({**CUDA, "nccl_problem": "node1: cuda_nccl_versions has no entry"}) == [
        "node1: cuda_nccl_versions has no entry"
    ]
    assert cuda_input_problems({**CUDA, "nccl_install": False, "nccl_version": "bad"}) == []


def test_cuda_version_the_toolkit_and_the_driver_are_checked_against_each_other():
    bad = {
        **CUDA,
        "distribution": "Rocky",
        "version": "9",
        "cuda_version": "12",
        "toolkit_install": True,
        "toolkit_source": "distro",
        "distro_toolkit_version": "11.8",
        "driver_cuda": "11.8",
    }
    assert cuda_input_problems(bad) == [
        "node1: runs Rocky 9; budgetgpu.cluster.cuda supports Ubuntu 22.04/24.04 and Debian 12/13",
        "node1: cuda_version is '12': expected MAJOR.MINOR such as 12.4",
        "node1: cuda_version is 12 but Rocky 9's nvidia-cuda-toolkit is CUDA 11.8: set cuda_toolkit_source:"
        " nvidia_repo, or cuda_version to 11.8",
        "node1: cuda_version is 12 but the loaded driver 550.54.14 runs CUDA 11.8 at most: upgrade the driver"
        " (nvidia_driver_branch) or pick an older cuda_version and NCCL",
    ]
