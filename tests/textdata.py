"""Shared by the text tests: the ShareGPT prompts' path, a ChatML template and its special tokens, a BPE trainer, a
tiny random Llama checkpoint with that tokenizer."""

import os

SHAREGPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data",
                        "sharegpt_v3_filtered_500.json")
if not os.path.isfile(SHAREGPT):  # a worktree beside the shared folder's parent
    SHAREGPT = "/work/shared/data/sharegpt_v3_filtered_500.json"
if not os.path.isfile(SHAREGPT):  # the GPU machine: the copy carried in the ignored .gpu_data folder
    SHAREGPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".gpu_data", "sharegpt.json")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def train_bpe(texts: list[str], path: str, vocab_size: int, chat_template: str | None = None) -> str:
    """A byte-level BPE of ``vocab_size`` tokens trained on ``texts`` (Qwen2's split), saved in ``path`` as a
    Hugging Face tokenizer directory (tokenizer.json and a tokenizer_config.json with ``chat_template``, default
    ChatML); returns ``path``."""
    import json

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from models.text import GGUF_PRE_SPLITS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GGUF_PRE_SPLITS["qwen2"]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": chat_template or CHATML,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, fh)
    return path


def write_tiny_llama(bpe: str, path, num_layers: int = 2) -> str:
    """A tiny random Llama checkpoint (transformers' save_pretrained) of ``num_layers`` layers written to ``path``,
    with the ``bpe`` tokenizer directory's tokenizer and its ChatML template (needs torch and transformers)."""
    import shutil

    import torch
    import transformers

    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(bpe, f), os.path.join(path, f))
    vocab = transformers.AutoTokenizer.from_pretrained(bpe).vocab_size
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, initializer_range=0.1, eos_token_id=None)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)
