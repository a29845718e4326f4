"""Sweep building blocks: search-space parsing, storages, settings, the in-job trial handle."""


import optuna
import pytest

from kdsweep.config import ConfigError
from kdsweep.sweep import study as S
from kdsweep.sweep.handle import TrialHandle
from kdsweep.sweep.manifest import STORAGE_ENV, Manifest
from kdsweep.sweep.space import parse_space


def test_space_kinds():
    space = {p.key: p for p in parse_space({
        "kd_ratio": "interval(0.0,1.0)", "lr": "tag(log, interval(1e-5,1e-2))", "lora_rank": "choice(4,8,16)",
        "train.max_steps": "range(20,100,20)", "data.seq_len": "interval(64,256)",
    })}
    assert space["kd_ratio"].distribution() == optuna.distributions.FloatDistribution(0.0, 1.0)
    assert space["lr"].distribution().log
    assert space["lora_rank"].distribution().choices == (4, 8, 16)
    assert space["train.max_steps"].distribution() == optuna.distributions.IntDistribution(20, 80, step=20)
    assert space["data.seq_len"].kind == "int"  # integer bounds on an int field: an integer space
    # the saved description (what resume compares) keeps a bound of 0
    assert space["kd_ratio"].describe() == {"key": "kd_ratio", "kind": "float", "low": 0.0, "high": 1.0}


@pytest.mark.parametrize("params,message", [
    ({}, "hydra.sweeper.params is empty"),
    ({"kd_ratio": "interval(0,1)"}, "integer bounds make an integer space"),
    ({"lr": "interval(0.01,0.001)"}, "the interval is empty"),
    ({"lr": "tag(log, interval(0.0,1.0))"}, "log scale needs a positive lower bound"),
    ({"lr": "0.1"}, "is a single value, not a search space"),
])
def test_space_mistakes_are_one_line(params, message):
    with pytest.raises(ConfigError, match=message) as e:
        parse_space(params)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("field,value,message", [
    ("sampler", "cmaes2", "hydra.sweeper.sampler='cmaes2' is unknown"),
    ("pruner", "sometimes", "hydra.sweeper.pruner='sometimes' is unknown"),
    ("max_concurrent", 0, "hydra.sweeper.max_concurrent=0"),
    ("directions", ("minimize", "minimize"), "directions"),
    ("workers", -1, "hydra.sweeper.workers=-1 must be >= 0"),
])
def test_settings_mistakes(field, value, message):
    with pytest.raises(ConfigError, match=message):
        S.SweepSettings(**{field: value})


@pytest.mark.parametrize("workers,params,enqueue,size", [
    (None, {"kd_ratio": "interval(0.0,1.0)"}, (), 3),  # the default: one warm worker per slot
    (None, {"dist.nproc_per_node": "choice(1,2)"}, (), 0),  # a searched worker shape: one job per trial
    (None, {"lr": "interval(0.001,0.01)"}, ({"lr": 0.01, "train.device": "cpu"},), 0),  # or an enqueued one
    (0, {"kd_ratio": "interval(0.0,1.0)"}, (), 0),
    (2, {"kd_ratio": "interval(0.0,1.0)"}, (), 2),
    (5, {"kd_ratio": "interval(0.0,1.0)"}, (), 3),  # never more workers than slots
])
def test_how_many_warm_workers_run_the_trials(workers, params, enqueue, size):
    settings = S.SweepSettings(workers=workers, max_concurrent=3, params=params, enqueue=enqueue)
    assert settings.pool_size == size


def test_passwords_are_redacted():
    assert S.redact("postgresql+psycopg2://kd:s3cr3t@db:5432/x") == "postgresql+psycopg2://kd:***@db:5432/x"
    assert S.redact("postgresql://kd@db/x") == "postgresql://kd@db/x"


def test_sqlite_on_nfs_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "_filesystem_type", lambda path: "nfs4")
    with pytest.raises(ConfigError, match="journal:///.*postgresql"):
        S.make_storage(f"sqlite:///{tmp_path / 'x.db'}")


def test_the_default_storage_is_sqlite_on_a_local_disk_and_a_journal_file_on_a_shared_filesystem(tmp_path,
                                                                                                   monkeypatch):
    shared, local = tmp_path / "lustre", tmp_path / "lustre" / "scratch"
    local.mkdir(parents=True)
    mounts = tmp_path / "mounts"  # as /proc/mounts writes them; the longest mount point holding a path is its own
    mounts.write_text(f"/dev/vda1 / ext4 rw,relatime 0 0\n10.0.0.5@tcp:/fs {shared} lustre rw,flock 0 0\n"
                      f"/dev/nvme0n1 {local} xfs rw 0 0\n")
    monkeypatch.setenv(S.MOUNTS_ENV, str(mounts))
    sweep = shared / "runs" / "sweep1"  # not made yet: the nearest directory that exists tells
    assert S.default_storage(sweep) == (f"journal://{sweep / 'optuna.journal'}", "a journal file: the sweep "
                                        "directory is on lustre, where SQLite's locks are unsafe")
    assert S.default_storage(local / "sweep") == (f"sqlite:///{local / 'sweep' / 'optuna.db'}",
                                                  "SQLite: the sweep directory is on xfs")
    assert S.storage_url(S.SweepSettings(), sweep).startswith("journal:///")
    url = "postgresql+psycopg2://kd@db/x"  # a storage the sweep names is its storage
    assert S.storage_url(S.SweepSettings(storage=url), sweep) == url
    # a sweep's directory that already holds a study keeps it (a resume, the dashboard), whatever the mount says now
    (local / "old").mkdir()
    (local / "old" / "optuna.journal").write_text("")
    assert S.default_storage(local / "old")[0] == f"journal://{local / 'old' / 'optuna.journal'}"
    sweep.mkdir(parents=True)
    (sweep / "optuna.db").write_text("")
    assert S.default_storage(sweep) == (f"sqlite:///{sweep / 'optuna.db'}", "SQLite (the sweep's own)")


def test_unreachable_storage_is_one_line_without_the_password(tmp_path):
    with pytest.raises(ConfigError) as e:
        S.make_storage("sqlite:////no/such/dir/x.db")
    assert "cannot be reached" in str(e.value)


@pytest.mark.parametrize("kind,objective", [("sqlite", "student_ce"), ("journal", "kl")])
def test_trial_handle_reports_and_prunes_through_the_storage(tmp_path, kind, objective, monkeypatch):
    url = f"sqlite:///{tmp_path / 'o.db'}" if kind == "sqlite" else f"journal://{tmp_path / 'j' / 'study.log'}"
    settings = S.SweepSettings(study_name="h", storage=url, pruner="median", pruner_startup_trials=1,
                               objectives=(objective,))
    Manifest.open(tmp_path, settings, [], [])
    monkeypatch.setenv(STORAGE_ENV, url)
    study = optuna.create_study(study_name="h", storage=S.make_storage(url), pruner=S.make_pruner(settings))
    dist = {"x": optuna.distributions.FloatDistribution(0, 1)}
    first = study.ask(dist)
    for step, value in ((1, 1.0), (2, 0.5)):
        first.report(value, step)
    study.tell(first, 0.5)
    second = study.ask(dist)
    handle = TrialHandle(str(tmp_path), second.number)  # as a job would: from the sweep dir and the number
    evals = {"student_ce": 0.1, "kl": 0.1, objective: 5.0}  # the study's objective is what the pruner sees
    assert handle.report(1, evals) is True  # far worse than the completed trial's median at step 1
    reloaded = optuna.load_study(study_name="h", storage=S.make_storage(url))
    assert reloaded.trials[1].intermediate_values == {1: 5.0}
    assert reloaded.trials[1].state == optuna.trial.TrialState.RUNNING  # only the controller tells states


def test_a_trial_handle_of_an_lm_eval_objective_reports_nothing_before_the_end(tmp_path, monkeypatch):
    """An lm-eval task is scored once a trial has trained: its evaluations have no value of it to report or prune
    on (the trial's evals lack the key)."""
    url = f"sqlite:///{tmp_path / 'o.db'}"
    settings = S.SweepSettings(study_name="h", storage=url, pruner="median", pruner_startup_trials=0,
                               objectives=("lm_eval/kdsweep_next_word",), directions=("maximize",))
    Manifest.open(tmp_path, settings, [], [])
    monkeypatch.setenv(STORAGE_ENV, url)
    study = optuna.create_study(study_name="h", storage=S.make_storage(url), direction="maximize",
                                pruner=S.make_pruner(settings))
    trial = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    handle = TrialHandle(str(tmp_path), trial.number)
    assert handle.report(1, {"student_ce": 4.5, "kl": 0.5, "teacher_ce": 4.4}) is False
    assert optuna.load_study(study_name="h", storage=S.make_storage(url)).trials[0].intermediate_values == {}


@pytest.mark.parametrize("pruner", ["halving", "percentile", "median"])
@pytest.mark.parametrize("grace", [0, 20])
def test_the_grace_period_keeps_a_slow_start_until_that_step(pruner, grace):
    """pruner_warmup_steps: no trial is pruned before that step, whichever the pruner (halving takes it as its first
    rung); from it on, a trial that stays the worst is pruned."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    settings = S.SweepSettings(pruner=pruner, pruner_warmup_steps=grace, pruner_startup_trials=2)
    study = optuna.create_study(pruner=S.make_pruner(settings), sampler=optuna.samplers.RandomSampler(seed=0))
    for value in (1.0, 1.1, 1.2, 1.3, 1.4, 1.5):  # good trials, learning steadily, asking at each eval as jobs do
        trial = study.ask()
        for step in (10, 20, 30, 40):
            trial.report(value - step / 100, step)
            trial.should_prune()
        study.tell(trial, value - 0.4)
    late = study.ask()  # the worst by far at every eval
    pruned_at = next((step for step in (10, 20, 30) if late.report(9.0, step) or late.should_prune()), None)
    if grace or pruner != "halving":
        assert pruned_at == (grace or 10)
    else:  # halving's own smallest resource (auto): it prunes, at a rung Optuna derives from the first trial
        assert pruned_at is not None


@pytest.mark.parametrize("given, pruner, idle", [
    ({"pruner_startup_trials": 4}, "halving", ["pruner_startup_trials"]),
    ({"pruner_percentile": 90.0, "pruner_warmup_steps": 20}, "median", ["pruner_percentile"]),
    ({"pruner_percentile": 90.0, "pruner_startup_trials": 4, "pruner_warmup_steps": 20}, "percentile", []),
    ({"pruner_warmup_steps": 20}, "none", ["pruner_warmup_steps"]),
    ({"pruner_warmup_steps": 2}, "halving", []),
])
def test_a_pruner_setting_the_pruner_does_not_read_is_named(given, pruner, idle):
    lines = S.SweepSettings(pruner=pruner, **given).idle_knobs()
    assert [line.split("=", 1)[0].removeprefix("hydra.sweeper.") for line in lines] == idle
    assert all(f"does nothing with hydra.sweeper.pruner={pruner}" in line for line in lines)


def test_a_study_of_several_objectives_prunes_nothing_and_says_so():
    settings = S.SweepSettings(pruner="halving", pruner_warmup_steps=20, objectives=("student_ce", "kl"),
                               directions=("minimize", "minimize"))
    assert settings.idle_knobs() == ["hydra.sweeper.pruner_warmup_steps=20 does nothing with a study of several "
                                     "objectives (no pruning)"]


@pytest.mark.parametrize("method, params, warned", [
    ("sample", {"kd_ratio": "interval(0.0,1.0)", "lr": "interval(1e-3,1e-2)"}, True),
    ("topk", {"kd_ratio": "choice(0.5,0.9)"}, True),
    ("full", {"kd_ratio": "interval(0.0,1.0)"}, False),
    (None, {"kd_ratio": "interval(0.0,1.0)"}, False),  # a live teacher
    ("sample", {"lr": "interval(1e-3,1e-2)"}, False),
])
def test_a_search_over_kd_ratio_from_a_biased_cache_is_warned_of(method, params, warned):
    line = S.cache_bias_line(method, params)
    assert (line is not None) == warned
    if warned:
        assert f"teacher.cache.method={method}" in line and "teacher.cache.method=full" in line


def test_the_default_pruner_is_halving_with_a_grace_period_that_follows_train_max_steps():
    """The rule benchmarks/sweep_async.py chose, its first rung at half the steps whatever train.max_steps is set to
    (the presets once copied 20 of 40 and 500 of 1,000, stale under an override)."""
    from kdsweep.sweep.study import make_pruner

    SweepSettings = S.SweepSettings
    default = SweepSettings()
    assert default.pruner == "halving" and default.pruner_warmup_steps is None
    assert [default.with_grace(n).pruner_warmup_steps for n in (40, 1000, 8, 1)] == [20, 500, 4, 1]
    assert SweepSettings(pruner_grace=0.25).with_grace(40).pruner_warmup_steps == 10
    assert SweepSettings(pruner_warmup_steps=7).with_grace(40).pruner_warmup_steps == 7  # given: kept
    assert SweepSettings(pruner_grace=0.0).with_grace(40).pruner_warmup_steps == 0  # Optuna's own
    pruner = make_pruner(default.with_grace(40))
    assert type(pruner).__name__ == "SuccessiveHalvingPruner" and pruner._min_resource == 20
    with pytest.raises(ConfigError, match="hydra.sweeper.pruner_grace=1.0 must be in"):
        SweepSettings(pruner_grace=1.0)
    assert SweepSettings(pruner="none", pruner_grace=0.3).idle_knobs() == [
        "hydra.sweeper.pruner_grace=0.3 does nothing with hydra.sweeper.pruner=none"]


def test_every_storage_method_optuna_s_cache_calls_is_retried_through_an_outage():
    """Optuna's _CachedStorage (what a study wraps an RDB storage in) calls these on it: each must be a patient one,
    or an Optuna upgrade that calls another would fail the sweep on a database restart again."""
    import inspect
    import re

    from optuna.storages import _cached_storage
    from optuna.storages import RDBStorage

    from kdsweep.sweep.patient import PATIENT, PatientRDBStorage

    heartbeat = {"get_heartbeat_interval", "get_heartbeat_stale_trial_callback", "record_heartbeat"}  # not used
    called = set(re.findall(r"_backend\.(\w+)\(", inspect.getsource(_cached_storage))) - heartbeat
    assert called and called <= set(PATIENT)
    for name in PATIENT:
        assert getattr(PatientRDBStorage, name) is not getattr(RDBStorage, name)
        assert getattr(PatientRDBStorage, name).__wrapped__ is getattr(RDBStorage, name)
