"""The ``README.md`` of a saved folder, from its files and its training record.

Built with ``huggingface_hub.ModelCardData`` / ``ModelCard`` so the YAML block is exactly what the
Hub (and ``ModelCard.load``) parses. What the card says comes, in this order, from the arguments
given, the folder's record (``hf_zero_training.json``, see :mod:`hf_zero.hub.model_cards.record`),
and the folder's own files (``config.json``'s architecture, ``adapter_config.json``'s base model).
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from hf_zero.hub.model_cards.record import hub_id_of, read_record

CARD_TEMPLATE = "README.md.j2"
WEIGHT_PATTERNS: tuple[str, ...] = ("*.safetensors", "pytorch_model*.bin", "*.gguf", "*.pt")

# transformers' auto mapping (in modeling_auto) whose values name the class -> (Auto class, Hub pipeline tag)
_AUTO_MAPPINGS: tuple[tuple[str, str, str | None], ...] = (
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM", "text-generation"),
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM", "text2text-generation"),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForSequenceClassification", "text-classification"),
    ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "AutoModelForTokenClassification", "token-classification"),
    ("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", "AutoModelForQuestionAnswering", "question-answering"),
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM", "fill-mask"),
    ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification", "image-classification"),
    ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "AutoModelForSpeechSeq2Seq", "automatic-speech-recognition"),
    ("MODEL_MAPPING_NAMES", "AutoModel", "feature-extraction"),
)
# peft task_type -> (peft Auto class, Hub pipeline tag)
_PEFT_TASKS: dict[str, tuple[str, str | None]] = {
    "CAUSAL_LM": ("AutoPeftModelForCausalLM", "text-generation"),
    "SEQ_2_SEQ_LM": ("AutoPeftModelForSeq2SeqLM", "text2text-generation"),
    "SEQ_CLS": ("AutoPeftModelForSequenceClassification", "text-classification"),
    "TOKEN_CLS": ("AutoPeftModelForTokenClassification", "token-classification"),
    "QUESTION_ANS": ("AutoPeftModelForQuestionAnswering", "question-answering"),
    "FEATURE_EXTRACTION": ("AutoPeftModelForFeatureExtraction", "feature-extraction"),
}


def _read_json(folder: str, name: str) -> dict[str, Any]:
    try:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def head_of(architectures: Sequence[str]) -> tuple[str, str | None]:
    """The Auto class that loads a model of these architectures, and the Hub's pipeline tag for it."""
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:  # pragma: no cover - transformers is a dependency
        modeling_auto = None
    for arch in architectures:
        for mapping, auto_class, tag in _AUTO_MAPPINGS:
            names = getattr(modeling_auto, mapping, {}) if modeling_auto is not None else {}
            if any(arch == v or (isinstance(v, (list, tuple)) and arch in v) for v in names.values()):
                return auto_class, tag
    return "AutoModel", None


def _peft_head(adapter_config: Mapping[str, Any]) -> tuple[str, str | None]:
    task = adapter_config.get("task_type")
    if task in _PEFT_TASKS:
        return _PEFT_TASKS[task]
    mapping = adapter_config.get("auto_mapping") or {}
    if isinstance(mapping, Mapping) and mapping.get("base_model_class"):
        _, tag = head_of([mapping["base_model_class"]])
        return "AutoPeftModel", tag
    return "AutoPeftModel", None


def _human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"  # pragma: no cover - the loop always returns


def _zero_stage(zero_config: Mapping[str, Any] | None) -> int | None:
    if not zero_config:
        return None
    section = zero_config.get("zero_optimization", zero_config)  # a whole config, or just its ZeRO section
    stage = section.get("stage") if isinstance(section, Mapping) else None
    return stage if isinstance(stage, int) else None


def hardware_text(record: Mapping[str, Any]) -> str | None:
    """``2 x NVIDIA H100 80GB HBM3 (nccl, world size 2)`` from a record's devices."""
    devices = record.get("devices")
    if not isinstance(devices, Mapping) or not devices:
        return None
    parts = ", ".join(f"{n} x {name}" for name, n in devices.items())
    extra = [str(record["backend"])] if record.get("backend") else []
    if record.get("world_size"):
        extra.append(f"world size {record['world_size']}")
    return parts + (f" ({', '.join(extra)})" if extra else "")


@dataclass
class _Model:
    """What a folder holds, as the card must describe it."""

    adapter: bool  # a PEFT adapter folder (peft loads it), not full weights
    what: str  # "LlamaForCausalLM", "A LORA adapter"
    auto_class: str  # the class the loading snippet uses
    pipeline_tag: str | None
    peft_type: str | None


def _model_in(folder: str, record: Mapping[str, Any]) -> tuple[_Model, dict[str, Any]]:
    """The folder's model (from its config files, else from the record) and its adapter config."""
    config = _read_json(folder, "config.json")
    adapter_config = _read_json(folder, "adapter_config.json")
    if config or adapter_config:
        adapter = bool(adapter_config) and not config
    else:  # no model saved in the folder yet (a Trainer's card before save_model): what the record says
        adapter = bool(record.get("adapter"))
        adapter_config = {"task_type": record.get("peft_task_type"), "peft_type": record.get("peft_type")} if adapter else {}
        config = {"architectures": [record["model_class"]]} if record.get("model_class") and not adapter else {}
    peft_type = adapter_config.get("peft_type") if adapter else None
    if adapter:
        auto_class, tag = _peft_head(adapter_config)
        what = f"A {peft_type or 'PEFT'} adapter"
    else:
        auto_class, tag = head_of(config.get("architectures") or [])
        what = ", ".join(config.get("architectures") or []) or "A model"
    return _Model(adapter, what, auto_class, tag, peft_type), adapter_config


def _eval_dataset(given: Mapping[str, Any] | None, datasets: list[str]) -> dict[str, Any] | None:
    """What the metrics were measured on, as a model-index entry names it: ``type`` (the Hub dataset id, or a
    name of one's own for data that is not on the Hub), ``name``, and ``split``/``config`` when known; else the
    first of the card's datasets; None when nothing names it (a model-index entry must)."""
    if given:
        missing = [k for k in ("type", "name") if not given.get(k)]
        if missing:
            from hf_zero.errors import HubError

            raise HubError(f"eval_dataset={dict(given)!r} has no {' or '.join(missing)}; a model-index entry needs both "
                           "(type: the Hub dataset id or a name of your own, name: a readable name)")
        return {k: str(given[k]) for k in ("type", "name", "split", "config") if given.get(k)}
    return {"type": datasets[0], "name": datasets[0]} if datasets else None


def _card_data(model: _Model, library: str, base: str | None, datasets: list[str], metrics: Mapping[str, float],
               zero_config: Mapping[str, Any] | None, name: str, metadata: dict[str, Any],
               evaluated_on: Mapping[str, str] | None) -> Any:
    """The YAML metadata: library, base model, datasets, tags, pipeline tag, and a model-index when it can have one."""
    from huggingface_hub import EvalResult, ModelCardData

    tags = ["hf_zero"] + (["transformers"] if library == "transformers" else [library, "transformers"])
    stage = _zero_stage(zero_config)
    if stage is not None:
        tags.append(f"zero-stage-{stage}")
    if model.peft_type:
        tags.append(str(model.peft_type).lower())
    tags += [t for t in metadata.pop("tags", None) or [] if t not in tags]
    pipeline_tag = metadata.pop("pipeline_tag", model.pipeline_tag)
    eval_results = None
    if metrics and evaluated_on:  # a model-index entry must name its dataset
        eval_results = [
            EvalResult(task_type=pipeline_tag or "other", dataset_type=evaluated_on["type"], dataset_name=evaluated_on["name"],
                       dataset_split=evaluated_on.get("split"), dataset_config=evaluated_on.get("config"),
                       metric_type=key, metric_name=key.replace("_", " "), metric_value=value)
            for key, value in metrics.items()
        ]
    return ModelCardData(
        library_name=library, base_model=base, datasets=datasets or None, tags=tags,
        pipeline_tag=pipeline_tag, eval_results=eval_results, model_name=name if eval_results else None, **metadata,
    )


def render_model_card(
    folder: str | os.PathLike,
    *,
    base_model: str | None = None,
    datasets: Sequence[str] | str | None = None,
    metrics: Mapping[str, float] | None = None,
    zero_config: Mapping[str, Any] | None = None,
    hardware: str | None = None,
    throughput: float | str | None = None,
    hyperparameters: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    repo_id: str | None = None,
    model_name: str | None = None,
    eval_dataset: Mapping[str, Any] | None = None,
) -> str:
    """The ``README.md`` text for ``folder``: YAML metadata the Hub indexes, then how the model was trained.

    Metadata: ``library_name`` (``peft`` for an adapter folder, ``transformers`` for full weights),
    ``base_model`` when it is a Hub id (:func:`~hf_zero.hub.model_cards.record.hub_id_of`: a local path never
    is; the first of the argument, the record and an adapter's ``base_model_name_or_path`` that gives one),
    ``datasets``, the ``hf_zero`` and ZeRO-stage tags, the pipeline tag of the architecture, and a
    ``model-index`` when there are metrics and a dataset to name: ``eval_dataset`` (``type``, ``name``,
    optional ``split``/``config``; also read from the record), else the first of ``datasets``; without one
    the metrics appear only in the body.
    The body: how to load it, base model, datasets, hardware, throughput (tokens/s when a number),
    hyperparameters, results, the resolved ZeRO config, framework versions and the weight files.
    Arguments override the folder's record. ``extra`` holds further metadata fields (``license``,
    ``language``, more ``tags`` ...).
    """
    from huggingface_hub import ModelCard

    from hf_zero.errors import HubError

    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise HubError(f"cannot write a model card for {folder}: it is not a directory.")
    record = read_record(folder)
    model, adapter_config = _model_in(folder, record)
    named = [n for n in (base_model, record.get("base_model"), adapter_config.get("base_model_name_or_path")) if n]
    base = next((i for i in map(hub_id_of, named) if i), None)
    dataset_list = [datasets] if isinstance(datasets, str) else list(datasets or record.get("datasets") or [])
    metrics = dict(metrics if metrics is not None else record.get("metrics") or {})
    zero_config = zero_config if zero_config is not None else record.get("zero_config")
    metadata = dict(extra or {})
    library = metadata.pop("library_name", None) or ("peft" if model.adapter else record.get("library_name") or "transformers")
    name = model_name or (repo_id or os.path.basename(os.path.abspath(folder))).split("/")[-1]
    evaluated_on = _eval_dataset(eval_dataset if eval_dataset is not None else record.get("eval_dataset"), dataset_list)
    card_data = _card_data(model, library, base, dataset_list, metrics, zero_config, name, metadata, evaluated_on)
    throughput = throughput if throughput is not None else record.get("throughput")
    files = sorted(
        (f, _human_size(os.path.getsize(os.path.join(folder, f))))
        for f in os.listdir(folder)
        if os.path.isfile(os.path.join(folder, f)) and any(fnmatch.fnmatch(f, p) for p in WEIGHT_PATTERNS)
    )
    template = resources.files("hf_zero.hub.model_cards").joinpath(CARD_TEMPLATE).read_text(encoding="utf-8")
    card = ModelCard.from_template(
        card_data,
        template_str=template,
        model_name=name,
        summary=f"{model.what} trained with hf_zero" + (f", fine-tuned from `{base}`." if base else "."),
        adapter=model.adapter,
        merged=bool(record.get("merged_adapters")),
        auto_class=model.auto_class,
        repo_hint=repo_id or "path/to/this/folder",
        base_model=base,
        local_base=bool(named) and base is None,
        datasets=dataset_list,
        evaluated_on=evaluated_on,
        metrics=metrics,
        hardware=hardware or hardware_text(record),
        throughput_text=f"{throughput:,.0f} tokens/s" if isinstance(throughput, (int, float)) else throughput,
        hyperparameters=dict(hyperparameters if hyperparameters is not None else record.get("hyperparameters") or {}),
        zero_config_json=json.dumps(dict(zero_config), indent=2) if zero_config else None,
        versions=dict(record.get("framework_versions") or {}),
        files=files,
    )
    return str(card)
