"""The README's serve-and-curl example, run as written (the port alone moved to a free one): the server starts on
SmolLM2, the curl answers 200 with an answer and SGLang's support fields, every sampled id inside its support."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from processes import process
from support_replay.launch import free_port
from support_replay.modeling.checkpoints import smollm2_checkpoint

README = Path(__file__).parents[1] / "README.md"


def readme_block(first_words: str) -> list[str]:
    """The bash block of the README that starts with ``first_words``, as its commands (continuation lines joined)."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    block = next(b for b in blocks if b.startswith(first_words))
    commands, current = [], ""
    for line in block.splitlines():
        current = f"{current}\n{line}" if current else line
        if current.count("'") % 2 == 0:  # a quoted body spans lines until its quote closes
            commands.append(current)
            current = ""
    return commands


@pytest.mark.slow
@pytest.mark.processes
def test_the_serve_and_curl_example_shows_the_support(tmp_path):
    smollm2_checkpoint()  # the README's note: converts the GGUF `make` installs, once
    serve, curl = readme_block("support-replay serve")
    port = str(free_port())
    serve, curl = serve.replace("30000", port), curl.replace("30000", port)
    assert curl.startswith("curl -s localhost:") and "Content-Type: application/json" in curl
    on_path = f"export PATH={Path(sys.executable).parent}:$PATH"  # `support-replay` as make installs it
    with process(["bash", "-c", f"{on_path} && cd {tmp_path} && exec {serve}"], f"http://127.0.0.1:{port}"):
        done = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
    answer = json.loads(done.stdout)
    meta = answer["meta_info"]
    assert answer["text"].strip() and meta["completion_tokens"] >= 1, answer
    ids = answer["output_ids"]
    rows = meta["output_token_sampling_mask"]
    assert len(rows) == len(ids) == meta["output_token_sampling_mask_length"]
    assert all(token in row and 1 <= len(row) <= 32 for token, row in zip(ids, rows))
