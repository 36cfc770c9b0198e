"""A corpus of real DeepSpeed configs from public repositories, and what hf_zero's parser makes of each.

The configs are in ``tests/ds_configs/``, byte for byte as their repositories hold them (a JSON
file cannot carry a comment, so each one's source is the row of :data:`CORPUS` that names it:
repository, path and the commit it was read at). The three from transformers' DeepSpeed guide are
the JSON blocks of that page, cut at the code fences.

``python -m tests.ds_corpus`` rewrites ``COMPATIBILITY.md`` from this table and the parser's verdicts;
``tests/test_ds_corpus.py`` checks the file is current, and that every config is accepted or refused
only for a feature hf_zero does not have yet.
"""

from __future__ import annotations

import copy
import json
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIGS = Path(__file__).resolve().parent / "ds_configs"
COMPATIBILITY = REPO / "COMPATIBILITY.md"
# The Trainer column: {file: "one line"}, what tests/test_ds_corpus_trainer.py observed (it rewrites the file
# when HF_ZERO_UPDATE_TRAINER_RUNS=1, and fails when a run shows anything else).
TRAINER_RUNS = Path(__file__).resolve().parent / "ds_corpus_trainer_runs.json"
# Those runs: optimizer steps per config, and what the user picks where a config says "auto" or nothing
# (lr 1e-3 moves bf16 weights within the steps; accumulating 2 micro-batches runs the Trainer's accumulation).
TRAINER_STEPS, USER_LR, USER_MICRO, USER_GAS = 3, 1e-3, 2, 2

OFFLOAD = "offload is not supported yet"  # partial optimizer offload (ratio < 1)
AS_DEEPSPEED = "DeepSpeed 0.19.8 refuses unknown keys in"  # a key DeepSpeed's pydantic model refuses too
NVME = '"nvme" (ZeRO-Infinity) is not supported'  # offload to NVMe
SEQUENCE_PARALLEL = "sequence parallelism is not supported yet"


@dataclass(frozen=True)
class Source:
    """One config: its file here, and where it was read."""

    file: str
    repo: str
    path: str
    commit: str
    # A feature hf_zero refuses that this config exists to show (a DeepSpeed feature demo), besides
    # offload and sequence parallelism, which any config may ask for until their issues land.
    refuses: str = ""
    where: str = ""  # the block of the page, when the config is one block of a longer file

    @property
    def url(self) -> str:
        return f"https://github.com/{self.repo}/blob/{self.commit}/{self.path}"

    def load(self) -> dict:
        return json.loads((CONFIGS / self.file).read_text(encoding="utf-8"))


TRANSFORMERS_DOCS = ("huggingface/transformers", "docs/source/en/deepspeed.md", "83b507b780f4d46fcab18cb429fb7439599821c5")
LLAMA_FACTORY = ("hiyouga/LLaMA-Factory", "ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30")
AXOLOTL = ("axolotl-ai-cloud/axolotl", "067b021c8b87a9e5e380b9173c704cf7340e30f5")
ACCELERATE = ("huggingface/accelerate", "16cb6eb80dd9aa8b4df1a63ef57863e455d53b83")
MS_SWIFT = ("modelscope/ms-swift", "3602360a562313afbf2ef6065fdf61f271a2c5b9")
LLAVA = ("haotian-liu/LLaVA", "c121f0432da27facab705978f83c4ada465e46fd")
OPEN_INSTRUCT = ("allenai/open-instruct", "e6c3044aa6201c8bfa4573c1b03142af599e730d")
FASTCHAT = ("lm-sys/FastChat", "0e6d3e4beaab66f4d3f93db72541a4abab8af28d")
ALPACA = ("tatsu-lab/stanford_alpaca", "761dc5bfbdeeffa89b8bff5d038781a4055f796a")
DS_EXAMPLES = ("deepspeedai/DeepSpeedExamples", "45b4b7156c8794a3452a5a7d03dbd8d797068569")


def _at(repo_commit: tuple[str, str], file: str, path: str, **kw: str) -> Source:
    return Source(file, repo_commit[0], path, repo_commit[1], **kw)


CORPUS: list[Source] = [
    # transformers: the DeepSpeed guide (ZeRO-1, ZeRO-3 and NVMe blocks) and the test suite's configs
    Source("transformers_docs_zero1.json", *TRANSFORMERS_DOCS, where='"ZeRO configuration", ZeRO-1 block'),
    Source("transformers_docs_zero3.json", *TRANSFORMERS_DOCS, where='"ZeRO configuration", ZeRO-3 block'),
    Source("transformers_docs_zero3_nvme.json", *TRANSFORMERS_DOCS, where='"NVMe configuration" block'),
    Source("transformers_tests_ds_config_zero2.json", "huggingface/transformers", "tests/deepspeed/ds_config_zero2.json",
           "9490c0a0ba8b4c001ab6a6bc038b5caca4d573ae"),
    Source("transformers_tests_ds_config_zero3.json", "huggingface/transformers", "tests/deepspeed/ds_config_zero3.json",
           "e7a14199e5d8cd78571ebfcde8221b16a1950ac4"),
    Source("transformers_tests_ds_config_zero2_bf16.json", "huggingface/transformers",
           "tests/deepspeed/ds_config_zero2_bf16.json", "a9c1721ff6eeba4729ba7760c6ec809c72935b2b"),
    Source("transformers_tests_ds_config_zero3_bf16.json", "huggingface/transformers",
           "tests/deepspeed/ds_config_zero3_bf16.json", "a9c1721ff6eeba4729ba7760c6ec809c72935b2b"),
    # Accelerate: the config templates, the test suite's configs, the ALST sequence-parallel example
    _at(ACCELERATE, "accelerate_zero_stage1_config.json", "examples/deepspeed_config_templates/zero_stage1_config.json"),
    _at(ACCELERATE, "accelerate_zero_stage2_config.json", "examples/deepspeed_config_templates/zero_stage2_config.json"),
    _at(ACCELERATE, "accelerate_zero_stage2_offload_config.json",
        "examples/deepspeed_config_templates/zero_stage2_offload_config.json"),
    _at(ACCELERATE, "accelerate_zero_stage3_config.json", "examples/deepspeed_config_templates/zero_stage3_config.json"),
    _at(ACCELERATE, "accelerate_zero_stage3_offload_config.json",
        "examples/deepspeed_config_templates/zero_stage3_offload_config.json"),
    _at(ACCELERATE, "accelerate_tests_ds_config_zero2.json", "tests/deepspeed/ds_config_zero2.json"),
    _at(ACCELERATE, "accelerate_tests_ds_config_zero3.json", "tests/deepspeed/ds_config_zero3.json"),
    _at(ACCELERATE, "accelerate_tests_ds_config_zero2_model_only.json", "tests/deepspeed/ds_config_zero2_model_only.json"),
    _at(ACCELERATE, "accelerate_tests_ds_config_zero3_model_only.json", "tests/deepspeed/ds_config_zero3_model_only.json"),
    _at(ACCELERATE, "accelerate_sp-alst.json", "examples/alst_ulysses_sequence_parallelism/sp-alst.ds-config.json"),
    # LLaMA-Factory: examples/deepspeed
    _at(LLAMA_FACTORY, "llamafactory_ds_z0_config.json", "examples/deepspeed/ds_z0_config.json"),
    _at(LLAMA_FACTORY, "llamafactory_ds_z2_config.json", "examples/deepspeed/ds_z2_config.json"),
    _at(LLAMA_FACTORY, "llamafactory_ds_z2_offload_config.json", "examples/deepspeed/ds_z2_offload_config.json"),
    _at(LLAMA_FACTORY, "llamafactory_ds_z3_config.json", "examples/deepspeed/ds_z3_config.json"),
    _at(LLAMA_FACTORY, "llamafactory_ds_z3_offload_config.json", "examples/deepspeed/ds_z3_offload_config.json"),
    _at(LLAMA_FACTORY, "llamafactory_ds_z3_fp8_config.json", "examples/deepspeed/ds_z3_fp8_config.json"),
    _at(LLAMA_FACTORY, "llamafactory_ds_z2_autotp_config.json", "examples/deepspeed/ds_z2_autotp_config.json"),
    # axolotl: deepspeed_configs
    _at(AXOLOTL, "axolotl_zero1.json", "deepspeed_configs/zero1.json"),
    _at(AXOLOTL, "axolotl_zero1_torch_compile.json", "deepspeed_configs/zero1_torch_compile.json"),
    _at(AXOLOTL, "axolotl_zero2.json", "deepspeed_configs/zero2.json"),
    _at(AXOLOTL, "axolotl_zero2_torch_compile.json", "deepspeed_configs/zero2_torch_compile.json"),
    _at(AXOLOTL, "axolotl_zero3.json", "deepspeed_configs/zero3.json"),
    _at(AXOLOTL, "axolotl_zero3_bf16.json", "deepspeed_configs/zero3_bf16.json"),
    _at(AXOLOTL, "axolotl_zero3_bf16_cpuoffload_all.json", "deepspeed_configs/zero3_bf16_cpuoffload_all.json"),
    _at(AXOLOTL, "axolotl_zero3_bf16_cpuoffload_params.json", "deepspeed_configs/zero3_bf16_cpuoffload_params.json"),
    # ms-swift: swift/config
    _at(MS_SWIFT, "msswift_zero0.json", "swift/config/zero0.json"),
    _at(MS_SWIFT, "msswift_zero1.json", "swift/config/zero1.json"),
    _at(MS_SWIFT, "msswift_zero2.json", "swift/config/zero2.json"),
    _at(MS_SWIFT, "msswift_zero2_offload.json", "swift/config/zero2_offload.json"),
    _at(MS_SWIFT, "msswift_zero3.json", "swift/config/zero3.json"),
    _at(MS_SWIFT, "msswift_zero3_offload.json", "swift/config/zero3_offload.json"),
    # LLaVA, open-instruct (JSON in .conf files), FastChat, Stanford Alpaca
    _at(LLAVA, "llava_zero2.json", "scripts/zero2.json"),
    _at(LLAVA, "llava_zero3.json", "scripts/zero3.json"),
    _at(LLAVA, "llava_zero3_offload.json", "scripts/zero3_offload.json"),
    _at(OPEN_INSTRUCT, "openinstruct_stage2_no_offloading_accelerate.json",
        "configs/ds_configs/stage2_no_offloading_accelerate.conf"),
    _at(OPEN_INSTRUCT, "openinstruct_stage3_no_offloading.json", "configs/ds_configs/stage3_no_offloading.conf"),
    _at(OPEN_INSTRUCT, "openinstruct_stage3_no_offloading_accelerate.json",
        "configs/ds_configs/stage3_no_offloading_accelerate.conf"),
    _at(OPEN_INSTRUCT, "openinstruct_stage3_offloading.json", "configs/ds_configs/stage3_offloading.conf"),
    _at(OPEN_INSTRUCT, "openinstruct_stage3_offloading_accelerate.json", "configs/ds_configs/stage3_offloading_accelerate.conf"),
    _at(FASTCHAT, "fastchat_deepspeed_config_s2.json", "playground/deepspeed_config_s2.json"),
    _at(FASTCHAT, "fastchat_deepspeed_config_s3.json", "playground/deepspeed_config_s3.json"),
    _at(ALPACA, "alpaca_default_offload_opt_param.json", "configs/default_offload_opt_param.json"),
    # DeepSpeedExamples: the autotuning configs for HF models, and training examples
    _at(DS_EXAMPLES, "dsexamples_autotuning_ds_config_z0.json", "training/autotuning/hf/dsconfigs/ds_config_z0.json"),
    _at(DS_EXAMPLES, "dsexamples_autotuning_ds_config_z1.json", "training/autotuning/hf/dsconfigs/ds_config_z1.json"),
    _at(DS_EXAMPLES, "dsexamples_autotuning_ds_config_z2.json", "training/autotuning/hf/dsconfigs/ds_config_z2.json"),
    _at(DS_EXAMPLES, "dsexamples_autotuning_ds_config_z3.json", "training/autotuning/hf/dsconfigs/ds_config_z3.json"),
    _at(DS_EXAMPLES, "dsexamples_autotuning_ds_config_fp16_z2.json", "training/autotuning/hf/dsconfigs/ds_config_fp16_z2.json"),
    _at(DS_EXAMPLES, "dsexamples_autotuning_ds_config_fp16_z3.json", "training/autotuning/hf/dsconfigs/ds_config_fp16_z3.json"),
    _at(DS_EXAMPLES, "dsexamples_pipeline_parallelism.json", "training/pipeline_parallelism/ds_config.json"),
    _at(DS_EXAMPLES, "dsexamples_imagenet_ds_fp16_z1.json", "training/imagenet/config/ds_fp16_z1_config.json"),
    _at(DS_EXAMPLES, "dsexamples_gan.json", "training/gan/gan_deepspeed_config.json"),
    _at(DS_EXAMPLES, "dsexamples_bf16_master_weight_baseline.json", "training/bf16_master_weight/configs/baseline.json"),
    # bf16 masters, gradients and Adam state, with torch_autocast
    _at(DS_EXAMPLES, "dsexamples_bf16_master_weight_bf16_full.json", "training/bf16_master_weight/configs/bf16_full.json"),
    _at(DS_EXAMPLES, "dsexamples_autosp_torchcompile.json", "benchmarks/autosp/configs/torchcompile_config.json"),
    # DeepSpeed feature demos: each exists to show a DeepSpeed feature (ZenFlow's trains; the others show features
    # hf_zero has no issue for yet)
    _at(DS_EXAMPLES, "dsexamples_zenflow.json", "training/DeepSpeed-ZenFlow/finetuning/zf_config.json"),
    _at(DS_EXAMPLES, "dsexamples_tensor_parallel_hf.json", "training/tensor_parallel/hf_integration/configs/ds_config.json"),
    _at(DS_EXAMPLES, "dsexamples_autosp.json", "benchmarks/autosp/configs/autosp_config.json",
        refuses="DeepCompile is not supported"),  # and sequence_parallel_size 2, refused after it
]

# Configs DeepSpeed 0.19.8's own parser refuses, with its "auto" values filled (tests/test_ds_config_oracle.py
# checks this list). hf_zero accepts the axolotl ones, naming compile.disable (older DeepSpeed read no compile
# section); it refuses the transformers one for the same key as DeepSpeed, and the AutoSP one for DeepCompile.
DEEPSPEED_REFUSES = {
    "axolotl_zero1_torch_compile.json": "its CompileConfig has no field compile.disable, which 0.14.4-0.16.5 ignored",
    "axolotl_zero2_torch_compile.json": "its CompileConfig has no field compile.disable, which 0.14.4-0.16.5 ignored",
    "transformers_docs_zero3_nvme.json": "the page puts the aio block inside zero_optimization, where it is forbidden",
    # DeepSpeedConfig divides the world by sequence_parallel_size: 2 at the oracle's world size 1 leaves half a rank
    "dsexamples_autosp.json": "sequence_parallel_size 2 at the oracle's world size of 1 process",
}

# What transformers' Trainer writes over "auto" (HfTrainerDeepSpeedConfig), by key name, for the oracle.
AUTO_VALUES: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
    "lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "warmup_min_lr": 0.0,
    "warmup_max_lr": 1e-4, "warmup_num_steps": 10, "total_num_steps": 100, "enabled": False,
    "reduce_bucket_size": 16384, "stage3_prefetch_bucket_size": 14745, "stage3_param_persistence_threshold": 1280,
    "allgather_bucket_size": 16384, "stage3_gather_16bit_weights_on_model_save": True, "opt_level": "O1",
}


def fill_autos(config: dict) -> dict:
    """A copy of ``config`` with every "auto" replaced by a value, as the Trainer fills them before DeepSpeed parses.

    ``train_batch_size: "auto"`` is dropped (DeepSpeed derives it from the micro-batch); a config
    with no batch size at all (a page's ``zero_optimization`` block) gets the Trainer's micro-batch.
    """
    out = copy.deepcopy(config)

    def walk(section: dict) -> None:
        for key, value in list(section.items()):
            if isinstance(value, dict):
                walk(value)
            elif value == "auto":
                if key == "train_batch_size":
                    del section[key]
                else:
                    section[key] = AUTO_VALUES[key]

    walk(out)
    if "train_batch_size" not in out and "train_micro_batch_size_per_gpu" not in out:
        out["train_micro_batch_size_per_gpu"] = AUTO_VALUES["train_micro_batch_size_per_gpu"]
    return out


@dataclass
class Verdict:
    """What ``ZeroConfig.load`` made of one config: the refusal sentence, or the keys its warnings named."""

    refused: str = ""
    ignored: tuple[str, ...] = ()  # DeepSpeed keys hf_zero accepts but ignores, that asked for something
    unknown: tuple[str, ...] = ()  # keys DeepSpeed does not know either
    legacy: tuple[str, ...] = ()  # keys older DeepSpeed accepted and DeepSpeed 0.19.8 refuses (their paths)


def verdict(config: dict | str) -> Verdict:
    """Parse as a fresh process would (every warning shown), and sort what came out."""
    from hf_zero.config import ConfigError, ZeroConfig
    from hf_zero.config import parse as config_parse

    saved = set(config_parse._WARNED)
    config_parse._WARNED.clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                ZeroConfig.load(config)
            except ConfigError as e:
                return Verdict(refused=str(e))
    finally:
        config_parse._WARNED.clear()
        config_parse._WARNED.update(saved)
    out = Verdict()
    for w in caught:
        text = str(w.message)
        head, _, names = text.partition(": ")
        keys = tuple(re.split(r", (?![^(]*\))", names))  # a key's "(why)" may hold commas
        if "accepts but ignores" in head:
            out.ignored = keys
        elif "not DeepSpeed config keys" in head:
            out.unknown = keys
        elif "DeepSpeed 0.19.8 refuses" in head:
            out.legacy = tuple(k.split(" (")[0] for k in keys)
        else:
            raise AssertionError(f"an unexpected warning while parsing: {text}")
    return out


def refused_for(message: str, source: Source) -> str:
    """The missing feature a refusal names, if it is one a corpus config may be refused for, else "".

    A config DeepSpeed 0.19.8 refuses too (:data:`DEEPSPEED_REFUSES`) may be refused for the key DeepSpeed's
    pydantic model refuses: "as DeepSpeed 0.19.8".
    """
    as_deepspeed = AS_DEEPSPEED if source.file in DEEPSPEED_REFUSES else ""
    for feature, sentence in (("offload", OFFLOAD), ("offload", NVME), ("sequence parallelism", SEQUENCE_PARALLEL),
                              (source.refuses.split(" is not")[0], source.refuses), ("as DeepSpeed 0.19.8", as_deepspeed)):
        if sentence and sentence in message:
            return feature
    return ""


def _cell(v: Verdict, source: Source) -> str:
    if v.refused:
        given = v.refused.split(", but ")[0]
        return f"refused ({refused_for(v.refused, source) or 'unexpectedly'}): `{given}`"
    parts = ["accepted"]
    if v.ignored:
        parts.append("ignored: " + ", ".join(f"`{k}`" for k in v.ignored))
    if v.unknown:
        parts.append("not DeepSpeed keys, ignored: " + ", ".join(f"`{k}`" for k in v.unknown))
    if v.legacy:
        parts.append("older DeepSpeed's, refused by 0.19.8: " + ", ".join(f"`{k}`" for k in v.legacy))
    return "; ".join(parts)


# Below this line COMPATIBILITY.md holds sections other generators write (the conformance harness's, for
# one); compatibility_markdown keeps them as they are.
KEEP_MARKER = "<!-- sections below are not generated by tests.ds_corpus, which keeps them as they are -->"


def _kept_sections() -> str:
    text = COMPATIBILITY.read_text(encoding="utf-8") if COMPATIBILITY.exists() else ""
    at = text.find(KEEP_MARKER)
    return "\n" + text[at:] if at >= 0 else ""


def compatibility_markdown() -> str:
    """COMPATIBILITY.md, from the corpus and the parser's verdicts (and the Trainer runs, once recorded).

    What follows :data:`KEEP_MARKER` in the current file is kept unchanged.
    """
    runs = json.loads(TRAINER_RUNS.read_text()) if TRAINER_RUNS.exists() else {}
    lines = [
        "# Compatibility with real DeepSpeed configs",
        "",
        "Generated by `python -m tests.ds_corpus` from `tests/ds_corpus.py` (do not edit by hand;",
        "`tests/test_ds_corpus.py` fails when this file is stale). Each config is in `tests/ds_configs/`,",
        "verbatim from the repository and commit linked in the Source column.",
        "",
        "**Parse** is what `hf_zero.config.ZeroConfig.load` does with the file as published (`\"auto\"` left in,",
        "as the Trainer passes it): *accepted*, naming the keys its warnings name (DeepSpeed keys that ask",
        "for something hf_zero does not do, keys that are not DeepSpeed's, and keys older DeepSpeed accepted that",
        "DeepSpeed 0.19.8 refuses), or *refused* with the sentence a user sees. The rule is in",
        "[docs/config.md](docs/config.md#the-rule-for-every-key). What is still refused is DeepCompile, NVMe offload without an `nvme_path`, and a",
        "key DeepSpeed 0.19.8 refuses too; the last four rows are DeepSpeed feature demos. NVMe offload (ZeRO-Infinity,",
        "`\"device\": \"nvme\"` with the `aio` section) runs as [docs/offload.md](docs/offload.md#nvme-offload-zero-infinity)",
        "says, which also lists what of it does not run yet (parameters on NVMe without `offload_optimizer`, with",
        "`overlap_param_gather`, GPUDirect Storage) and the keys it names as ignored (`offload_param.buffer_size`, `fast_init`).",
        "",
        "**Trainer (2 ranks)** is what `tests/test_ds_corpus_trainer.py` observed running the file, verbatim, through",
        "`hf_zero.TrainingArguments(deepspeed=<file>)` + `hf_zero.Trainer` on 2 gloo CPU ranks (a tensor-parallel config",
        "on as many ranks as its `autotp_size` asks, if more): *trains* means a tiny `LlamaForCausalLM` (built from a",
        f"config: hidden 16, 2 layers, 4 heads) took {TRAINER_STEPS} optimizer steps to finite losses with its",
        "weights moved, and the `save_model` folder loads with `from_pretrained` to exactly the trained weights;",
        "*refused* is the error raised when `TrainingArguments` is built (before any model), the same on both ranks.",
        "The arguments in each cell are those a user of the config sets: what the config fixes (precision, batch",
        "sizes, clipping, optimizer and scheduler values) copied, as transformers requires under DeepSpeed; where it",
        f"says `\"auto\"` or nothing, the user's picks: learning rate {USER_LR:g}, micro-batch {USER_MICRO}, accumulation {USER_GAS}, and bf16",
        "where a bf16 section is `\"auto\"`. The test fails when a run shows anything but the recorded cell",
        "(`tests/ds_corpus_trainer_runs.json`); rerunning it with `HF_ZERO_UPDATE_TRAINER_RUNS=1` rewrites that file",
        "and this one.",
        "",
        "fp16 on a CPU: transformers' own Trainer accepts `fp16=True` with `use_cpu=True`, but Accelerate turns on",
        "neither autocast nor a gradient scaler on a CPU device (its `native_amp` is off there for fp16), so the plain",
        "Trainer silently trains in fp32. hf_zero's engine does fp16 itself (fp16 weights, fp32 master weights,",
        "DeepSpeed's dynamic loss scaler), so the fp16 rows really run in fp16 here: each cell names the dtype the",
        "engine's weights had.",
        "",
        "DeepSpeed 0.19.8's own parser (with `\"auto\"` filled) accepts every config here except "
        + ", ".join(f"`{f}` ({why})" for f, why in DEEPSPEED_REFUSES.items())
        + ". hf_zero accepts the axolotl ones, naming `compile.disable` (DeepSpeed 0.14.4-0.16.5 read no `compile`"
        " section), refuses the NVMe one for the key DeepSpeed refuses (`zero_optimization.aio`) and the AutoSP one"
        " for DeepCompile.",
        "",
        "| Config | Source | Parse | Trainer (2 ranks) |",
        "|---|---|---|---|",
    ]
    for source in CORPUS:
        where = f" ({source.where})" if source.where else ""
        link = f"[{source.repo}/{source.path}@{source.commit[:7]}]({source.url}){where}"
        run = runs.get(source.file, "not run")
        lines.append(f"| [{source.file}](tests/ds_configs/{source.file}) | {link} | {_cell(verdict(str(CONFIGS / source.file)), source)} | {run} |")
    return "\n".join(lines) + "\n" + _kept_sections()


if __name__ == "__main__":
    COMPATIBILITY.write_text(compatibility_markdown(), encoding="utf-8")
    print(f"wrote {COMPATIBILITY} ({len(CORPUS)} configs)", file=sys.stderr)
