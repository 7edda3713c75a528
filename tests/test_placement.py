"""Where the gateway's workers run: GPUs dealt to a cluster's workers in turn, each seeing only its own, shared
GPUs split by memory fraction, a converted worker on the GPU it took over, and bad placements refused.

Building the placement needs no GPU (specs are flags and an environment); a worker is started for real to show
the environment reaches its process. Running on the GPUs themselves is tests/test_gpu.py's, on a machine with them.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

from minifaas.commands.serve import add_arguments, config_from_args
from minifaas.commands.worker import parse_args
from minifaas.commands.worker import run as run_worker
from minifaas.config import ClusterConfig, ServeConfig
from minifaas.control.secret import new_secret
from minifaas.launch.launcher import WorkerSpec
from minifaas.launch.local import LocalLauncher
from minifaas.launch.worker_specs import planned_specs, visible_gpu, worker_spec

MODEL = "kimi-linear-tiny"


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def flag(spec: WorkerSpec, name: str) -> str | None:
    return spec.argv[spec.argv.index(name) + 1] if name in spec.argv else None


def placed(config: ServeConfig) -> dict[str, tuple[str, str | None, str | None, str | None]]:
    """Per worker: its device, what CUDA_VISIBLE_DEVICES shows it, its --device and its memory fraction."""
    shown = {s.name: (s.device, dict(s.env).get("CUDA_VISIBLE_DEVICES")) for s in planned_specs(config)}
    return {n: (*shown[n], flag(s, "--device"), flag(s, "--gpu-memory-fraction")) for s in planned_specs(config)
            for n in [s.name]}  # fmt: skip


def test_each_worker_gets_a_gpu_of_its_own_and_sees_only_that_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = ServeConfig(
        model=MODEL,
        prfaas=ClusterConfig(prefill_workers=2, devices=("cuda:0", "cuda:3")),
        pd=ClusterConfig(prefill_workers=1, decode_workers=2, devices=("cuda:1", "cuda:2", "cuda:4")),
    )
    assert placed(config) == {
        "prfaas-p0": ("cuda:0", "0", "cuda:0", None),
        "prfaas-p1": ("cuda:3", "3", "cuda:0", None),
        "pd-p0": ("cuda:1", "1", "cuda:0", None),  # prefill workers first
        "pd-d0": ("cuda:2", "2", "cuda:0", None),
        "pd-d1": ("cuda:4", "4", "cuda:0", None),
    }
    assert config.pd.device == "cuda:1" and config.worker_dtype("pd") == "bfloat16"  # the kind of device


def test_workers_that_share_a_gpu_split_its_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    one_gpu = ServeConfig(model=MODEL, prfaas=ClusterConfig(device="cuda:0"), pd=ClusterConfig(1, 1, device="cuda:0"))
    assert {s.name: flag(s, "--gpu-memory-fraction") for s in planned_specs(one_gpu)} == {
        "prfaas-p0": "0.3333", "pd-p0": "0.3333", "pd-d0": "0.3333",
    }  # fmt: skip
    # PrfaaS asks for half; the PD workers split the rest. More than all of it is refused.
    asked = ServeConfig(
        model=MODEL, prfaas=ClusterConfig(device="cuda:0", memory_fraction=0.5), pd=ClusterConfig(1, 1, device="cuda:0")
    )
    assert [flag(s, "--gpu-memory-fraction") for s in planned_specs(asked)] == ["0.5", "0.25", "0.25"]
    with pytest.raises(ValueError, match="ask for more than all of it"):
        ServeConfig(
            model=MODEL,
            prfaas=ClusterConfig(device="cuda:0", memory_fraction=0.6),
            pd=ClusterConfig(1, 1, device="cuda:0", memory_fraction=0.3),
        )
    with pytest.raises(ValueError, match="ask for more than all of it"):  # nothing left for the PD workers
        ServeConfig(model=MODEL, prfaas=ClusterConfig(device="cuda:0", memory_fraction=1.0),
                    pd=ClusterConfig(1, 1, device="cuda:0"))  # fmt: skip
    # a CPU cluster beside them takes no GPU memory
    mixed = ServeConfig(model=MODEL, dtype="float32", prfaas=ClusterConfig(device="cuda:0"), pd=ClusterConfig(1, 1))
    assert [flag(s, "--gpu-memory-fraction") for s in planned_specs(mixed)] == [None, None, None]


def test_gpu_numbers_count_within_what_the_gateway_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    assert visible_gpu("cuda:1", {"CUDA_VISIBLE_DEVICES": "4,6"}) == "6"
    assert visible_gpu("cuda:2", {}) == "2"
    with pytest.raises(ValueError, match="shows 2 GPU"):
        visible_gpu("cuda:2", {"CUDA_VISIBLE_DEVICES": "4,6"})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    config = ServeConfig(model=MODEL, dtype="float32", pd=ClusterConfig(1, 1, devices=("cuda:1", "cuda:0")))
    spec = worker_spec(config, "pd-d0", "decode", "pd", "cuda:0")
    assert dict(spec.env) == {"CUDA_VISIBLE_DEVICES": "5"}


def test_a_converted_worker_keeps_the_gpu_of_the_one_it_replaces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = ServeConfig(model=MODEL, dtype="float32", pd=ClusterConfig(1, 2, devices=("cuda:1", "cuda:2", "cuda:3")))
    old = next(s for s in planned_specs(config) if s.name == "pd-d1")
    new = worker_spec(config, "pd-p1", "prefill", "pd", old.device)  # what RoleChanger starts in its place
    assert (new.device, new.env, flag(new, "--device")) == ("cuda:3", (("CUDA_VISIBLE_DEVICES", "3"),), "cuda:0")
    assert "--prefix-cache" in new.argv and "--max-batch" not in new.argv  # the new role's flags


def test_placements_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="give each device a worker"):
        ClusterConfig(prefill_workers=1, devices=("cuda:0", "cuda:1"))
    with pytest.raises(ValueError, match="distinct cuda:N"):
        ClusterConfig(prefill_workers=2, devices=("cuda:0", "cuda:0"))
    with pytest.raises(ValueError, match="distinct cuda:N"):
        ClusterConfig(prefill_workers=1, devices=("cpu",))
    with pytest.raises(ValueError, match="device or devices"):
        ClusterConfig(prefill_workers=1, device="cuda:2", devices=("cuda:0",))
    with pytest.raises(ValueError, match="a GPU's"):
        ClusterConfig(memory_fraction=0.5)
    with pytest.raises(ValueError, match="Ray gives each actor"):
        ServeConfig(launcher="ray", prfaas=ClusterConfig(devices=("cuda:0",)))


def test_the_flags_deal_one_worker_per_gpu_unless_counts_are_given() -> None:
    config = config_from_args(serve_args("--prfaas-devices", "cuda:0,cuda:1", "--pd-devices", "cuda:2,cuda:3,cuda:4"))
    assert (config.prfaas.prefill_workers, config.pd.prefill_workers, config.pd.decode_workers) == (2, 1, 2)
    assert config.pd.devices == ("cuda:2", "cuda:3", "cuda:4")
    told = config_from_args(serve_args("--pd-devices", "cuda:1", "--pd-decode-workers", "3", "--gpu-memory-fraction",
                                       "0.2", "--dtype", "float32"))  # fmt: skip
    assert (told.pd.prefill_workers, told.pd.decode_workers, told.pd.memory_fraction) == (1, 3, 0.2)
    assert told.prfaas.memory_fraction == 0  # the PrfaaS cluster is on the CPU
    with pytest.raises(ValueError, match="no cluster runs on a GPU"):
        config_from_args(serve_args("--gpu-memory-fraction", "0.5"))
    with pytest.raises(ValueError, match="not both"):
        config_from_args(serve_args("--pd-device", "cuda:0", "--pd-devices", "cuda:1"))
    with pytest.raises(SystemExit):  # argparse's error line
        serve_args("--pd-devices", "cuda:1,cpu")


def test_a_worker_refuses_a_memory_fraction_off_a_gpu(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text(new_secret().decode())
    key.chmod(0o600)
    with pytest.raises(Exception, match="gpu-memory-fraction"):
        run_worker(parse_args(["--role", "prefill", "--cluster", "pd", "--secret-file", str(key),
                               "--gpu-memory-fraction", "0.5"]))  # fmt: skip


def test_the_launcher_puts_a_workers_environment_into_its_process() -> None:
    config = ServeConfig(model=MODEL)
    spec = worker_spec(config, "pd-d0", "decode", "pd")
    spec = WorkerSpec(spec.name, spec.role, spec.cluster, spec.argv, env=(("MINIFAAS_PLACEMENT_PROBE", "cuda:7"),))

    async def scenario() -> bytes:
        async with LocalLauncher(new_secret()) as launcher:  # a fresh interpreter, as a GPU worker is
            await launcher.start(spec)
            with open(f"/proc/{launcher.processes[spec.name].pid}/environ", "rb") as f:
                return f.read()

    assert b"MINIFAAS_PLACEMENT_PROBE=cuda:7\0" in asyncio.run(scenario())


def test_the_demo_places_its_clusters_as_serve_does(monkeypatch: pytest.MonkeyPatch) -> None:
    from minifaas.commands import demo

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    flags = ["--prfaas-devices", "cuda:0", "--pd-devices", "cuda:1,cuda:2", "--gpu-memory-fraction", "0.9"]
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    from_demo = config_from_args(demo.served_args(parser.parse_args(["--model", MODEL, *flags])))
    from_serve = config_from_args(serve_args("--model", MODEL, "--port", "0", *flags))
    assert (
        placed(from_demo)
        == placed(from_serve)
        == {
            "prfaas-p0": ("cuda:0", "0", "cuda:0", "0.9"),
            "pd-p0": ("cuda:1", "1", "cuda:0", "0.9"),
            "pd-d0": ("cuda:2", "2", "cuda:0", "0.9"),
        }
    )
