"""Shared by the text tests: the ShareGPT prompts' path, a ChatML template and its special tokens."""

import os

SHAREGPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data",
                        "sharegpt_v3_filtered_500.json")
if not os.path.isfile(SHAREGPT):  # a worktree beside the shared folder's parent
    SHAREGPT = "/work/shared/data/sharegpt_v3_filtered_500.json"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
