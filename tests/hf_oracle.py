"""HF transformers' model of a GGUF file, the oracle of the real-model tests, in float32 as HF dequantizes it.

HF's GGUF load (its own dequantization, in NumPy) takes tens of seconds on a loaded CI machine, and several test
modules need it; the model it made is kept on disk as HF's own files (``config.json``, ``generation_config.json``,
``model.safetensors``) in cb_serve's GGUF cache (``gguf_cache.entry_dir``: keyed by the file's path, size and
modification time, under ``$CB_SERVE_CACHE_DIR``; empty: off), per transformers and torch version, and read back
with ``from_pretrained``: the same weights and configs, checked when written (``check_same``)."""

from __future__ import annotations

import shutil

import torch

from cb_serve.model_executor import gguf_cache, loader


def hf_model_from_gguf(source: loader.ModelSource) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path, gguf_file=..., dtype=float32)``, from the disk copy when there
    is one."""
    import transformers
    from transformers import AutoModelForCausalLM

    kind = f"hf-oracle-transformers-{transformers.__version__}-torch-{torch.__version__}"
    entry = gguf_cache.entry_dir(loader.gguf_stamp(source), kind)
    if entry is not None and (entry / gguf_cache.COMPLETE).is_file():
        return AutoModelForCausalLM.from_pretrained(entry, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, dtype=torch.float32)
    if entry is not None:
        save(model, entry)
    return model


def save(model: torch.nn.Module, entry) -> None:
    """HF's files of ``model`` (loaded from GGUF, which ``save_pretrained`` refuses), written whole or not at all."""
    from safetensors.torch import save_model

    tmp = entry.with_name(entry.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the GGUF file's: the weights saved are its dequantized floats
        type(model.config).from_dict(config).to_json_file(tmp / "config.json")
        model.generation_config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))
        check_same(model, tmp)
        shutil.rmtree(entry, ignore_errors=True)
        tmp.rename(entry)
        (entry / gguf_cache.COMPLETE).touch()
    except OSError:  # a read-only or full disk: the next run loads the GGUF file again
        shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:  # a copy that differs (check_same) is never left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_same(model: torch.nn.Module, directory) -> None:
    """The model ``from_pretrained`` reads from ``directory`` is ``model``: every tensor bit for bit, the configs."""
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    ours, theirs = model.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys(), set(ours) ^ set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), [k for k in ours if not torch.equal(ours[k], theirs[k])]
    skip = {"quantization_config", "_name_or_path", "transformers_version"}
    config = {k: v for k, v in model.config.to_dict().items() if k not in skip}
    assert config == {k: v for k, v in back.config.to_dict().items() if k not in skip}
    assert model.generation_config.to_dict() == back.generation_config.to_dict()
