"""Every option of every config group composes with Hydra and converts to a valid RunConfig."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kdsweep.app import conf_dir
from kdsweep.config import ConfigError, RunConfig, to_run_config

GROUPS = sorted(p.name for p in Path(conf_dir()).iterdir() if p.is_dir() and p.name not in ("hydra", "experiment"))
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((Path(conf_dir()) / g).glob("*.yaml"))]
EXPERIMENTS = sorted(p.stem for p in (Path(conf_dir()) / "experiment").glob("*.yaml"))
# Options that need a value only the user can give.
ONE = ["data.datasets.0.path=/data/train.jsonl"]
REQUIRED = {("data", "text"): ONE, ("data", "instruction"): ONE, ("data", "chat"): ONE,
            ("data", "mixture"): [*ONE, "data.datasets.1.path=/data/chats.parquet"],
            ("rollout", "on_policy"): ["data=instruction", *ONE], ("rollout", "seq_kd"): ["data=instruction", *ONE]}


def convert(overrides):
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    raw = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    raw["output_dir"] = "/tmp/out"
    return to_run_config(raw)


def test_every_group_has_options():
    assert set(GROUPS) == {"model", "teacher", "data", "loss", "optim", "train", "logger", "checkpoint", "dist", "cluster", "hparams_search", "profiler",
                           "rollout"}
    assert all(sum(1 for g, _ in OPTIONS if g == group) >= 2 for group in GROUPS)


@pytest.mark.parametrize("group,option", OPTIONS)
def test_option_composes_and_converts(group, option):
    cfg = convert([f"{group}={option}", *REQUIRED.get((group, option), [])])
    assert isinstance(cfg, RunConfig)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_composes_and_converts(experiment):
    cfg = convert([f"+experiment={experiment}", *ONE])
    assert cfg.model.path and cfg.teacher.path and cfg.train.dtype == "bf16"


def test_the_pinned_pairs_users_ask_for_exist():
    assert {"qwen2_5_7b_to_0_5b", "qwen3_8b_to_0_6b", "llama3_1_8b_to_3_2_1b", "gemma2_9b_to_2b"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_each_experiment_has_a_search_space_whose_every_corner_converts(experiment):
    """``-m +experiment=E hparams_search=E``: the sweeper's space parses, and every corner of it is a valid job."""
    from kdsweep.sweep.space import parse_space

    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        cfg = compose(config_name="config", overrides=[f"+experiment={experiment}", f"hparams_search={experiment}", *ONE],
                      return_hydra_config=True)
    params = OmegaConf.to_container(cfg.hydra.sweeper.params)
    assert cfg.hydra.sweeper.study_name == experiment and {"kd_ratio", "lr", "lora_rank"} <= set(params)
    space = parse_space(params)
    for p in space:
        for value in p.corners():
            job = convert([f"+experiment={experiment}", f"hparams_search={experiment}", *ONE, f"{p.key}={value}"])
            assert job.train.max_steps == 1000  # the experiment's training length, not the tiny search's


@pytest.mark.parametrize("group", ["model", "teacher"])
def test_real_model_presets_are_local_directories_or_hub_ids(group, monkeypatch):
    """Without KDSWEEP_CKPTS a preset names its hub id (read from the Hugging Face cache); with it, a directory."""
    from kdsweep.hub import HUB_ID

    for option in sorted(p.stem for p in (Path(conf_dir()) / group).glob("*.yaml")):
        if option in ("tiny", "tiny_other"):  # the embedded zoo's
            assert getattr(convert([f"{group}={option}"]), group).zoo.startswith("tiny-")
            continue
        monkeypatch.delenv("KDSWEEP_CKPTS", raising=False)
        hub = getattr(convert([f"{group}={option}"]), group).path
        assert HUB_ID.match(hub), (option, hub)
        monkeypatch.setenv("KDSWEEP_CKPTS", "/ckpts")
        local = convert([f"{group}={option}"])
        assert getattr(local, group).path == "/ckpts/" + hub.split("/", 1)[1]
        if group == "model":
            assert local.model.target_modules == ("all-linear",)


def test_sweep_knobs_reach_their_sections():
    cfg = convert(["kd_ratio=0.3", "lr=1e-4", "lora_rank=0"])
    assert (cfg.loss.kd_ratio, cfg.optim.lr, cfg.model.lora_rank) == (0.3, 1e-4, 0)
    default = convert([])
    assert default.model.zoo == "tiny-student" and default.teacher.zoo == "tiny-teacher" and default.model.lora_rank > 0


@pytest.mark.parametrize("option", ["text", "instruction", "chat", "mixture"])
def test_a_data_preset_without_its_path_is_refused_by_the_app_resolver(option):
    from kdsweep.app import resolve

    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        cfg = compose(config_name="config", overrides=[f"data={option}"])
    with pytest.raises(ConfigError, match=r"data.datasets\[0\].path is required but not set; pass data.datasets.0.path=<value>"):
        resolve(cfg)


def test_a_list_of_sources_from_the_command_line():
    cfg = convert(["data=mixture", "data.datasets=[{path:/a.jsonl,format:instruction,weight:3},{path:/b,format:chat}]"])
    a, b = cfg.data.datasets
    assert (a.path, a.format, a.weight, b.path, b.format, b.weight) == ("/a.jsonl", "instruction", 3.0, "/b", "chat", 1.0)
    assert cfg.data.mix == "weighted" and cfg.data.sequences == "pack"


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["kd_ratio=1.5"], "loss.kd_ratio"),
        (["kd_ratio=-0.1"], "loss.kd_ratio"),
        (["lora_rank=-1"], "model.lora_rank"),
        (["lr=0"], "optim.lr"),
        (["lr=-1e-3"], "optim.lr"),
        (["loss.temperature=0"], "loss.temperature"),
        (["loss.divergence=js"], "loss.divergence"),
        (["train.dtype=fp16"], "train.dtype"),
        (["data.batch_size=10", "data.micro_batch_size=4"], "data.batch_size"),
        (["data.eval_fraction=0"], "no eval split"),
        (["+train.foo=1"], "train.foo"),
        (["train.max_steps=ten"], "train.max_steps"),
    ],
)
def test_bad_values_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        convert(overrides)
    assert field in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("option", sorted(p.stem for p in (Path(conf_dir()) / "data").glob("*.yaml")))
def test_every_data_field_can_be_set_on_the_command_line(option):
    """Hydra refuses to override a key a preset lacks (struct mode): every preset holds every DataConfig field,
    and every source it lists every DatasetConfig field its format reads."""
    import dataclasses

    from kdsweep.config.schema import DataConfig

    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        cfg = compose(config_name="config", overrides=[f"data={option}"])
    assert [f.name for f in dataclasses.fields(DataConfig) if f.name not in cfg.data] == []
    columns = {"text": {"text_column"}, "instruction": {"instruction_column", "input_column", "output_column"},
               "chat": {"messages_column"}}
    for ds in cfg.data.datasets:
        assert {"path", "format", "weight", "split"} | columns[ds.format] <= set(ds.keys())


def test_the_gpu_cluster_preset_brings_its_gpu_dist_and_a_dist_on_the_command_line_still_wins():
    gpu = convert(["cluster=gpu_node"])
    assert gpu.train.dtype == "bf16" and gpu.dist.activation_checkpointing
    assert convert(["cluster=gpu_node", "dist=single"]).train.dtype == "fp32"
