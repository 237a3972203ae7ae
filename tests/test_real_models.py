"""`trl_statelens.real_models` without the real packages: the end-of-turn mend of a converted folder, on the lab's
tokenizer (whose chat template, like Gemma 3's, closes a turn with a token it flags special without naming it)."""

import json

from transformers import GenerationConfig

from trl_statelens.real_models import stop_at_turn_end


def test_a_folder_declaring_one_end_token_also_stops_at_its_turn_end(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id).save_pretrained(tmp_path)  # as the GGUF declares it
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    stop_at_turn_end(tmp_path, "<|im_end|>")
    assert GenerationConfig.from_pretrained(tmp_path).eos_token_id == [tokenizer.eos_token_id, im_end]

    before = (tmp_path / "generation_config.json").read_text()
    stop_at_turn_end(tmp_path, "<|im_end|>")  # a mended folder is left as it is
    assert (tmp_path / "generation_config.json").read_text() == before
    assert json.loads(before)["eos_token_id"] == [tokenizer.eos_token_id, im_end]
