"""The shipped reasoner's card pins its weights and names the commands behind its numbers.

Many tests depend on the shipped model's exact outputs, so the card records the sha256 of the
weights it describes; a changed model.safetensors must come with a changed card.
"""

import hashlib
import re
from pathlib import Path

import cleave

MODEL_DIR = Path(cleave.__file__).parent / "assets" / "reasoner"
REPO_ROOT = Path(__file__).resolve().parents[2]
CARD = (MODEL_DIR / "MODEL_CARD.md").read_text()
SHA256_RE = re.compile(r"^model\.safetensors sha256: `([0-9a-f]{64})`$", re.MULTILINE)
COMMAND_SCRIPT_RE = re.compile(r"python ((?:scripts|bench)/\w+\.py)")


def test_card_records_the_shipped_weights_sha256():
    (recorded,) = SHA256_RE.findall(CARD)
    assert hashlib.sha256((MODEL_DIR / "model.safetensors").read_bytes()).hexdigest() == recorded


def test_every_table_names_an_existing_script():
    scripts = set(COMMAND_SCRIPT_RE.findall(CARD))
    assert {"scripts/train_reasoner.py", "bench/reasoner_accuracy.py", "bench/thinking_budget.py"} <= scripts
    assert all((REPO_ROOT / script).is_file() for script in scripts), scripts
    for table_header in ("| decoding |", "| max_thinking_tokens |"):
        table_start = CARD.index(table_header)
        # the command that produced a table is stated in the paragraph just above it
        assert COMMAND_SCRIPT_RE.search(CARD[CARD.rfind("\n\n", 0, table_start - 1) : table_start]), table_header
