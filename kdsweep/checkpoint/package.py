"""``kdsweep export``: a finished run's student as a user ships it.

From a run directory, or a sweep's trial (``--trial N``), its best (``--best``: the search's best, the point its
verdict reports) or every seed of its confirmed point (``--confirmed``), each into a directory of its own:

- ``merged/``: the student with its adapter folded in and its tokenizer (and chat template, when it has one), for
  ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``;
- ``adapter/``: the peft adapter as trained (a LoRA run);
- ``README.md``: a model card of how it was made (base student, teacher, data, the knobs, what it scored, the
  sweep's verdict), and ``kdsweep_export.json``, the same as data.

The run kept its adapter (``checkpoint.export_adapter``, on in every shipped preset) or its merged model
(``checkpoint.export_merged``): the merge here loads the base student the run trained from and applies the adapter
with peft, as :func:`kdsweep.checkpoint.export.export` does at the end of a run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from kdsweep.config.schema import ConfigError
from kdsweep.metrics.records import read_run

CARD = "kdsweep_export.json"


def completed_record(run_dir: Path) -> dict[str, Any]:
    """A completed run's run.json (one line for a directory without one, or a run that did not complete)."""
    record = read_run(run_dir)
    if not record:
        raise ConfigError(f"{run_dir} holds no run.json: pass a run directory or a sweep directory (sweep.json)")
    if record.get("status") != "completed":
        raise ConfigError(f"{run_dir} did not complete (status {record.get('status')!r}): export a completed run")
    return record


def pick(path: Path, trial: int | None, confirmed: bool) -> tuple[list[tuple[str, Path]], dict[str, Any]]:
    """The runs to export (a name for each and its directory) and what the sweep says of them (its verdict): a run
    directory's run, a sweep's trial ``trial``, every completed seed of its confirmed point, or (neither) its best."""
    if not (path / "sweep.json").exists() and not (path / "run.json").exists():
        raise ConfigError(f"{path} holds neither sweep.json nor run.json: pass a sweep directory or a run directory")
    if not (path / "sweep.json").exists():
        if trial is not None or confirmed:
            raise ConfigError(f"{path} is a run directory: --trial and --confirmed pick from a sweep directory")
        return [(path.name, path)], {}
    from kdsweep.sweep.manifest import Manifest
    from kdsweep.sweep.summary import search_best

    manifest = Manifest.load(path)
    trials, verdict = manifest.trials, manifest.data.get("verdict") or {}
    about = {"sweep": str(path), "verdict": verdict.get("line")}
    if trial is not None:
        if str(trial) not in trials:
            known = ", ".join(sorted(trials, key=int)) or "none"
            raise ConfigError(f"trial {trial} is not in {path} (trials: {known})")
        return [(f"trial{trial}", Path(trials[str(trial)]["run_dir"]))], about
    plan = manifest.data.get("confirmation") or {}
    if confirmed:
        runs = confirmed_runs(manifest, verdict.get("best"))
        if not runs:
            raise ConfigError(f"{path} has no confirmed point (no verdict, or none of its seeds completed): "
                              "export --best or --trial N")
        return runs, about
    if plan.get("points"):  # the point the verdict reports: the search's best, fixed before its confirmation
        number = plan["points"][0]["search_trial"]
    elif len(manifest.data["settings"]["directions"]) > 1:
        raise ConfigError(f"{path} is a study of several objectives (no single best): export --trial N")
    elif (number := search_best(manifest)) is None:
        raise ConfigError(f"{path} has no completed search trial yet: nothing to export")
    return [(f"trial{number}", Path(trials[str(number)]["run_dir"]))], about


def confirmed_runs(manifest: Any, label: str | None) -> list[tuple[str, Path]]:
    """Every completed seed of the confirmation's point ``label`` (``<label>-seed<s>`` and its run directory), in
    trial order; none for no label."""
    runs = sorted((t for t in manifest.trials.values() if label and (t.get("confirm") or {}).get("label") == label
                   and t["confirm"]["seed"] is not None and t["state"] == "COMPLETE"), key=lambda t: t["number"])
    return [(f"{label}-seed{t['confirm']['seed']}", Path(t["run_dir"])) for t in runs]


def _student(record: dict[str, Any], run_dir: Path) -> tuple[Any, Any, str]:
    """The run's trained student (its adapter applied to the base it trained from, or its merged model) and its
    tokenizer, and which of the two it was."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exports, base = record.get("exports") or {}, (record.get("models") or {}).get("student")
    if exports.get("adapter") and Path(exports["adapter"]).exists():
        if not base or not Path(base).exists():
            raise ConfigError(f"the base student the run trained from ({base}) is gone: export needs it to merge")
        from peft import PeftModel

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), exports["adapter"])
        return model, AutoTokenizer.from_pretrained(base), "adapter"
    if exports.get("merged") and Path(exports["merged"]).exists():
        merged = exports["merged"]
        return AutoModelForCausalLM.from_pretrained(merged), AutoTokenizer.from_pretrained(merged), "merged"
    raise ConfigError(f"{run_dir} kept no adapter and no merged model: rerun it with "
                      "checkpoint.export_adapter=true (LoRA) or checkpoint.export_merged=true")


def card(record: dict[str, Any], run_dir: Path, about: dict[str, Any], name: str) -> dict[str, Any]:
    """What the model card says, as data: where the student came from and what it scored."""
    cfg = record.get("config") or {}
    models = record.get("models") or {}
    model = cfg.get("model") or {}
    return {
        "name": name, "run_dir": str(run_dir), "base_student": models.get("student"),
        "teacher": models.get("teacher"),
        "lora": {k: model.get(k) for k in ("lora_rank", "lora_alpha", "lora_dropout", "target_modules")},
        "data": {k: (cfg.get("data") or {}).get(k) for k in ("datasets", "seq_len", "batch_size")},
        "loss": cfg.get("loss"), "optim": cfg.get("optim"),
        "steps": record.get("steps"), "seed": (cfg.get("train") or {}).get("seed"),
        "eval_after": record.get("eval_after"), "test_after": record.get("test_after"),
        "downstream": record.get("downstream") or {}, **about,
    }


def _markdown(facts: dict[str, Any]) -> str:
    loss, optim, lora = facts["loss"] or {}, facts["optim"] or {}, facts["lora"]
    scored = facts["test_after"] or facts["eval_after"] or {}
    split = "test" if facts["test_after"] else "eval"
    num = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = [
        f"# {facts['name']}: a student distilled with kdsweep", "",
        f"- base student: `{facts['base_student']}`", f"- teacher: `{facts['teacher']}`",
        f"- loss: {loss.get('divergence')} at kd_ratio {num(loss.get('kd_ratio'))}, temperature "
        f"{num(loss.get('temperature'))}",
        f"- optimizer: AdamW, lr {num(optim.get('lr'))}, {facts['steps']} steps, seed {facts['seed']}",
        f"- LoRA: rank {lora['lora_rank']}, alpha {lora['lora_alpha']} on {', '.join(lora['target_modules'] or [])}"
        if lora.get("lora_rank") else "- full fine-tune",
        f"- data: {facts['data']['datasets'] or 'the embedded corpus'}, sequences of {facts['data']['seq_len']}",
        f"- {split} split: student CE {num(scored.get('student_ce'))}, KL to the teacher {num(scored.get('kl'))}",
        *(f"- lm-eval {task}: {d['metric']} {num(d['value'])}" + (f" ± {num(d['stderr'])} (standard error)"
                                                                  if d.get("stderr") is not None else "")
          + f", {d['items']} items" for task, d in facts.get("downstream", {}).items()),
        f"- run: `{facts['run_dir']}`",
    ]
    if facts.get("verdict"):
        lines.append(f"- the sweep's verdict (`{facts['sweep']}`): {facts['verdict']}")
    return "\n".join(lines) + "\n"


def export_run(run_dir: Path, out: Path, about: dict[str, Any], name: str) -> dict[str, str]:
    """Write ``out/merged``, ``out/adapter`` (a LoRA run), ``out/README.md`` and ``out/kdsweep_export.json``."""
    from kdsweep.checkpoint.export import export

    record = completed_record(run_dir)
    model, tokenizer, kept = _student(record, run_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = export(model, tokenizer, out, adapter=kept == "adapter", merged=True)
    if kept == "adapter":  # the merge ran on its own copy: the adapter as trained is the run's, copied
        tokenizer.save_pretrained(out / "adapter")
    facts = card(record, run_dir, about, name)
    (out / "README.md").write_text(_markdown(facts))
    (out / CARD).write_text(json.dumps({**facts, "written": written}, indent=2, default=str) + "\n")
    return written


def export_runs(path: Path, out: Path | None, trial: int | None, confirmed: bool) -> list[Path]:
    """Export what :func:`pick` picks, each into ``out / <name>`` (default: ``<path>/export``)."""
    runs, about = pick(path, trial, confirmed)
    out = out or path / "export"
    done = []
    for name, run_dir in runs:
        target = out / name
        if target.exists():
            shutil.rmtree(target)
        export_run(run_dir, target, about, name)
        done.append(target)
    return done


__all__ = ["CARD", "card", "completed_record", "confirmed_runs", "export_run", "export_runs", "pick"]
