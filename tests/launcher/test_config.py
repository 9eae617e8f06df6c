"""Launcher inputs and generated commands: hostfile, --include/--exclude, env files, runner argv."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from dsfunc.errors import Error
from dsfunc.launcher.commands import (
    Launch,
    LauncherError,
    mpi_hostfile_text,
    openmpi_command,
    pdsh_command,
    slurm_command,
    ssh_commands,
)
from dsfunc.launcher.cores import parse_core_list, rank_cores
from dsfunc.launcher.environment import EnvFileError, env_file_paths, exported_env, parse_env_file
from dsfunc.launcher.exits import RankState, exit_code
from dsfunc.launcher.flags import build_parser, parse_launcher_args
from dsfunc.launcher.node import decode_world_info, encode_world_info
from dsfunc.launcher.report import exit_code_of, first_failed
from dsfunc.launcher.resources import ResourceError, local_pool, parse_hostfile, select
from dsfunc.launcher.run import _rank_args
from dsfunc.launcher.shim import RankArgs, parse_rank_args

HOSTFILE = """\
# the cluster
worker-0 slots=2
worker-1 slots=4   # a comment

worker-2 slots=2 max_slots=2
"""
POOL = {"worker-0": [0, 1], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}


def test_hostfile_parses_in_order():
    assert parse_hostfile(HOSTFILE) == POOL
    assert list(parse_hostfile(HOSTFILE)) == ["worker-0", "worker-1", "worker-2"]


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "worker-0 slots=2\nworker-1 slot=2\n",
            "hf:2: bad hostfile entry 'worker-1 slot=2'; expected 'HOSTNAME slots=N'",
        ),
        ("worker-0 slots=2\nworker-1\n", "hf:2: bad hostfile entry 'worker-1'"),
        ("worker-0 slots=2 oops\n", "hf:1: bad hostfile entry"),
        ("\nworker-0 slots=0\n", "hf:2: host 'worker-0' has slots=0; slots must be at least 1"),
        ("a slots=1\nb slots=1\na slots=2\n", "hf:3: host 'a' is listed twice (first on line 1)"),
        ("# nothing\n\n", "hf: the hostfile has no 'HOSTNAME slots=N' entries"),
    ],
)
def test_hostfile_errors_name_the_line(text, message):
    with pytest.raises(ResourceError) as info:
        parse_hostfile(text, "hf")
    assert message in str(info.value)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"include": "worker-1:0,2@worker-2"}, {"worker-1": [0, 2], "worker-2": [0, 1]}),
        ({"include": "worker-2@worker-0:1"}, {"worker-0": [1], "worker-2": [0, 1]}),  # hostfile order kept
        ({"include": "worker-1:3,1,1"}, {"worker-1": [1, 3]}),
        ({"exclude": "worker-2:0,1@worker-1:0"}, {"worker-0": [0, 1], "worker-1": [1, 2, 3]}),
        ({"exclude": "worker-0"}, {"worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}),
        ({"num_nodes": 2}, {"worker-0": [0, 1], "worker-1": [0, 1, 2, 3]}),
        ({"num_gpus": 1}, {"worker-0": [0], "worker-1": [0], "worker-2": [0]}),
        ({"num_nodes": 1, "num_gpus": 2}, {"worker-0": [0, 1]}),
    ],
)
def test_select(kwargs, expected):
    assert select(POOL, **kwargs) == expected


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"include": "worker-9"},
            "--include: host 'worker-9' is not in the hostfile (known hosts: worker-0, worker-1",
        ),
        ({"exclude": "worker-0:5"}, "--exclude: host 'worker-0' has no slot 5 (its slots: 0, 1)"),
        ({"include": "worker-0:x"}, "slot 'x' of host 'worker-0' is not a non-negative integer"),
        ({"include": "a", "exclude": "b"}, "--include and --exclude are mutually exclusive"),
        (
            {"include": "worker-0", "num_gpus": 1},
            "--num_nodes/--num_gpus cannot be combined with --include/--exclude",
        ),
        ({"exclude": "worker-0@worker-1@worker-2"}, "no slot is left to run on"),
        ({"num_nodes": 4}, "--num_nodes 4 but only 3 host(s) are available"),
        ({"num_gpus": 3}, "--num_gpus 3 but host 'worker-0' has only 2 slot(s)"),
        ({"include": ":1"}, "has no host name"),
    ],
)
def test_select_errors(kwargs, message):
    with pytest.raises(ResourceError) as info:
        select(POOL, **kwargs)
    assert message in str(info.value)


def test_local_pool():
    assert local_pool(3, 0, None) == {"localhost": [0, 1, 2]}  # CPU: N processes
    assert local_pool(-1, 2, None) == {"localhost": [0, 1]}
    assert local_pool(-1, 2, "4,6") == {"localhost": [4, 6]}  # CUDA_VISIBLE_DEVICES ids become the slots
    with pytest.raises(ResourceError, match="pass --num_gpus N to run N processes on the CPU"):
        local_pool(-1, 0, None)
    with pytest.raises(ResourceError, match="more GPUs than this machine has"):
        local_pool(4, 2, None)


def test_env_file_parsing():
    text = '# settings\n\nA=1\n  B = two words \nC="quoted # kept"\nD=x=y\nE=\n'
    assert parse_env_file(text, "f") == {
        "A": "1",
        "B": "two words",
        "C": "quoted # kept",
        "D": "x=y",
        "E": "",
    }
    for bad, line in (("A=1\nno equals\n", 2), ("1A=2\n", 1), ("\n\n=3\n", 3)):
        with pytest.raises(EnvFileError, match=f"f:{line}: expected KEY=VALUE"):
            parse_env_file(bad, "f")


def test_env_files_order_and_exports(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("X=home-ds\nY=home\n")
    (cwd / ".deepspeed_env").write_text("X=cwd-ds\n")
    (cwd / ".dsfunc_env").write_text("X=cwd-dsfunc\n")
    paths = env_file_paths(str(cwd), str(home), {})
    assert paths == [str(home / ".deepspeed_env"), str(cwd / ".deepspeed_env"), str(cwd / ".dsfunc_env")]
    environ = {
        "NCCL_IB_DISABLE": "1",
        "UCX_TLS": "tcp",
        "MLFLOW_X": "m",
        "MV2_Y": "v",
        "PYTHONPATH": "/lib",
        "HOME": "/x",
        "CUDA_HOME": "/cuda",
    }
    exports = exported_env(environ, str(cwd), str(home))
    assert exports == {
        "NCCL_IB_DISABLE": "1",
        "UCX_TLS": "tcp",
        "MLFLOW_X": "m",
        "MV2_Y": "v",
        "PYTHONPATH": f"{cwd}:/lib",
        "X": "cwd-dsfunc",
        "Y": "home",
    }
    (home / "custom_env").write_text("Z=1\n")
    assert env_file_paths(str(cwd), str(home), {"DS_ENV_FILE": "custom_env"})[0] == str(home / "custom_env")


def _launch(resources, **kw) -> Launch:
    defaults = {
        "rank_args": ["--no_local_rank", "train.py", "--lr", "1e-3"],
        "master_addr": "10.0.0.1",
        "master_port": 29600,
        "exports": {"NCCL_DEBUG": "INFO", "MSG": "a b'c"},
        "cwd": "/work dir",
        "python": "/usr/bin/python3",
    }
    defaults.update(kw)
    return Launch(resources=resources, **defaults)


def test_world_info_roundtrip():
    assert decode_world_info(encode_world_info(POOL)) == POOL


def test_ssh_commands_run_the_node_agent_in_the_same_cwd_with_exports():
    launch = _launch({"w0": [0, 1], "w1": [2]}, launcher_args=["-F", "cfg"])
    cmds = ssh_commands(launch)
    assert [c[:4] for c in cmds] == [["ssh", "-F", "cfg", "w0"], ["ssh", "-F", "cfg", "w1"]]
    remote = shlex.split(cmds[1][4])
    assert remote[:3] == ["cd", "/work dir", "&&"]
    assert remote[3:6] == ["export", "NCCL_DEBUG=INFO", "MSG=a b'c;"]
    agent = remote[remote.index("exec") + 1 :]
    assert agent[:4] == ["/usr/bin/python3", "-u", "-m", "dsfunc.launcher.node"]
    assert decode_world_info(agent[4].split("=", 1)[1]) == {"w0": [0, 1], "w1": [2]}
    assert agent[5:] == [
        "--node_rank=1",
        "--master_addr=10.0.0.1",
        "--master_port=29600",
        "--max_restarts=0",
        "--stop_on_stdin_eof",
        "--stop_on_parent_exit",
        "--",
        "--no_local_rank",
        "train.py",
        "--lr",
        "1e-3",
    ]


def test_openmpi_command():
    launch = _launch({"w0": [0, 1], "w1": [0, 1]}, launcher_args=["--mca", "btl", "tcp,self"])
    cmd = openmpi_command(launch, "/tmp/hf")
    assert cmd == [
        "mpirun",
        "-n",
        "4",
        "--hostfile",
        "/tmp/hf",
        "-x",
        "NCCL_DEBUG=INFO",
        "-x",
        "MSG=a b'c",
        "-x",
        "MASTER_ADDR=10.0.0.1",
        "-x",
        "MASTER_PORT=29600",
        "--mca",
        "btl",
        "tcp,self",
        "/usr/bin/python3",
        "-u",
        "-m",
        "dsfunc.launcher.shim",
        "--no_local_rank",
        "train.py",
        "--lr",
        "1e-3",
    ]
    assert mpi_hostfile_text(launch.resources) == "w0 slots=2\nw1 slots=2\n"
    with pytest.raises(LauncherError, match=r"cannot pick particular slots \(w0: 1\)"):
        openmpi_command(_launch({"w0": [1]}), "/tmp/hf")


def test_slurm_command():
    cmd, env = slurm_command(_launch({"n1": [0, 1], "n2": [0, 1]}, launcher_args=["--partition=gpu"]), True)
    assert cmd == [
        "srun",
        "--nodes=2",
        "--ntasks=4",
        "--ntasks-per-node=2",
        "--nodelist=n1,n2",
        "--kill-on-bad-exit=1",
        "--export=ALL",
        "--partition=gpu",
        "/usr/bin/python3",
        "-u",
        "-m",
        "dsfunc.launcher.shim",
        "--no_local_rank",
        "train.py",
        "--lr",
        "1e-3",
    ]
    assert env == {"NCCL_DEBUG": "INFO", "MSG": "a b'c", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29600"}
    cmd, _ = slurm_command(_launch({"n1": [0, 1, 2], "n2": [0]}), False)
    assert cmd[:4] == ["srun", "--nodes=2", "--ntasks=4", "--kill-on-bad-exit=1"]


def test_pdsh_command():
    cmd, env = pdsh_command(_launch({"w0": [0], "w1": [0]}))
    assert cmd[:6] == ["pdsh", "-S", "-f", "1024", "-w", "w0,w1"] and env == {"PDSH_RCMD_TYPE": "ssh"}
    assert "--node_host=%h" in cmd[6] and "--stop_on_parent_exit" in cmd[6]


def test_cli_defaults_and_help():
    args = parse_launcher_args(["--launcher", "OpenMPI", "train.py", "--epochs", "3", "--num_gpus", "9"])
    assert (args.hostfile, args.hostfile_given, args.launcher) == ("/job/hostfile", False, "openmpi")
    assert (args.num_gpus, args.user_script, args.user_args) == (
        -1,
        "train.py",
        ["--epochs", "3", "--num_gpus", "9"],
    )
    # no --master_port: DeepSpeed's 29500, or a free port for a job on this machine alone (the launch picks)
    assert (args.master_port, args.max_restarts, args.enable_each_rank_log) == (None, 0, "None")
    text = " ".join(build_parser().format_help().split())
    assert "default: ssh when the job spans several nodes" in text
    for flag in (
        "--hostfile",
        "--include",
        "--exclude",
        "--num_nodes",
        "--num_gpus",
        "--master_addr",
        "--master_port",
        "--launcher_args",
        "--no_local_rank",
        "--force_multi",
        "--save_pid",
        "--enable_each_rank_log",
        "--max_restarts",
        "--collective_timeout",
        "--version",
        "--module",
        "--no_python",
    ):
        assert flag in text


@pytest.mark.parametrize("error", [LauncherError, ResourceError, EnvFileError])
def test_launcher_errors_are_dsfunc_errors_and_value_errors(error):
    assert issubclass(error, Error) and issubclass(error, ValueError)


def test_venv_script_is_sourced_before_the_agent():
    remote = shlex.split(ssh_commands(_launch({"w0": [0]}, venv_script="/venv dir/bin/activate"))[0][-1])
    assert remote[:6] == ["cd", "/work dir", "&&", ".", "/venv dir/bin/activate", "&&"]


def test_rank_args_roundtrip_through_the_shim_parser():
    args = parse_launcher_args(["--no_local_rank", "--bind_cores_to_rank", "--bind_core_list", "0-3",
                                "train.py", "--lr", "1"])
    rank = parse_rank_args(_rank_args(args))
    assert rank == RankArgs("train.py", ["--lr", "1"], local_rank_flag=False, bind_cores=True, core_list="0-3")
    assert parse_rank_args(["--module", "pkg.main"]).missing_target() is None  # modules are found by the rank


@pytest.mark.parametrize("text, cores", [("0", [0]), ("1,3-5,7", [1, 3, 4, 5, 7]), ("0-1, 4", [0, 1, 4])])
def test_core_lists_as_deepspeed_writes_them(text, cores):
    assert parse_core_list(text) == cores


@pytest.mark.parametrize("text", ["3-1", "2,1", "0-2,2", "a", "1-", "-1"])
def test_bad_core_lists(text):
    with pytest.raises(Error):
        parse_core_list(text)


def test_each_local_rank_gets_a_block_of_the_cores():
    assert [rank_cores("0-7", r, 3) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]  # 8 // 3 each, as DeepSpeed
    with pytest.raises(Error, match=r"2 core\(s\) \(4-5\) cannot give each of 3 local ranks one"):
        rank_cores("4-5", 0, 3)


@dataclasses.dataclass
class _Failure:
    exitcode: int
    timestamp: int = 100
    local_rank: int = 0


def _states(ended: dict, codes: dict | None = None) -> dict[int, RankState]:
    """What an exit clock knows: when each rank ended, the codes some said."""
    return {r: RankState(pid=100 + r, ended=t, code=(codes or {}).get(r)) for r, t in ended.items()}


def test_the_first_failure_is_the_earliest_end_the_clock_saw():
    failures = {0: _Failure(1), 1: _Failure(-15)}  # torch's order: rank 0 first, same second
    assert first_failed(failures, {}) == [0, 1]
    assert first_failed(failures, _states({0: 5.2, 1: 5.1})) == [1, 0]
    assert first_failed(failures, _states({0: 5.2})) == [0, 1]  # the clock missed one: torch's order
    # rank 1's program had ended with code 0 when the agent stopped it: not a failure, whatever its end
    assert first_failed(failures, _states({0: 5.2, 1: 5.1}, {1: 0})) == [0, 1]
    # both programs ended with code 0: the agent's SIGTERM is no cause, a crash in a shutdown is
    crashed = {0: _Failure(-15), 1: _Failure(-11)}
    assert first_failed(crashed, _states({0: 5.1, 1: 5.2}, {0: 0, 1: 0})) == [1, 0]
    # a rank dsfunc stopped as hung is the cause even when its death is seen after the failure it caused
    hung = _states({0: 5.1, 1: 5.2}, {0: 1})
    hung[1].hung = "it has not reached the collective rank 0 waited in"
    assert first_failed(failures, hung) == [1, 0]
    assert exit_code_of(failures, 1, _states({1: 5.1}, {1: 3})) == 3  # it said 3, then SIGTERM ended its shutdown
    assert exit_code_of(failures, 1, {}) == 128 + 15
    assert [exit_code(e) for e in (None, SystemExit(4), SystemExit(None), SystemExit("bye"), ValueError())] == [
        0, 4, 0, 1, 1]
