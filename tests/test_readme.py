"""README.md's "Running your own job" runs as written: its commands are read from the README, with
fewer iterations, the data and run folders under a temporary directory, and this session's corpus."""

import re
from fractions import Fraction
import shlex
import subprocess
import sys

from launch import REPO, read_jsonl

# Shorter, not different: the README's model, layout, data flags and tokenizer stay as they are.
OVERRIDES = {"--train-iters": "4", "--log-interval": "2", "--eval-interval": "2", "--eval-iters": "1"}


def readme_commands(section: str = "## Running your own job") -> list[str]:
    """The section's first bash block, one command per entry (continuations joined, comments cut)."""
    text = (REPO / "README.md").read_text()
    block = re.search(re.escape(section) + r"\n.*?```bash\n(.*?)```", text, re.S).group(1)
    joined = re.sub(r"\\\n\s*", "", block)
    return [line.split(" #")[0].strip() for line in joined.splitlines() if line.strip()]


def _shortened(command: str, tmp) -> str:
    words = shlex.split(command)
    for i, word in enumerate(words[:-1]):
        if word in OVERRIDES:
            words[i + 1] = OVERRIDES[word]
    words = [re.sub(r"^(data|runs)/", rf"{tmp}/\1/", w) for w in words]
    return shlex.join(words)


def test_running_your_own_job_as_written(tiny_dataset, tmp_path):
    commands = readme_commands()
    assert [c.split()[:2] for c in commands] == [
        ["source", "tools/setup_env.sh"], ["python", "tools/make_corpus.py"], ["python", "tools/train_tokenizer.py"],
        ["python", "tools/preprocess_data.py"], ["torchrun", "--nproc-per-node"]]
    (tmp_path / "data").mkdir()
    script = ["set -euo pipefail", _shortened(commands[0], tmp_path),
              # The corpus this session already made with the same tool (fewer documents: faster).
              f"cp {tiny_dataset / 'corpus.jsonl'} {_shortened(commands[1], tmp_path).split('--output ')[1]}"]
    script += [f"{_shortened(c, tmp_path)} > {tmp_path}/step{i}.log 2>&1" for i, c in enumerate(commands[2:], 2)]
    proc = subprocess.run(["bash", "-c", "\n".join(script)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "VENV": sys.prefix,
                               "OMP_NUM_THREADS": "1"})
    logs = {p.name: p.read_text() for p in sorted(tmp_path.glob("step*.log"))}
    assert proc.returncode == 0, proc.stderr + "\n".join(f"--- {k}\n{v[-3000:]}" for k, v in logs.items())
    records = read_jsonl(tmp_path / "runs/metrics.jsonl")
    assert [r["iteration"] for r in records if "lm_loss" in r] == [2, 4]
    assert [r["iteration"] for r in records if "val_loss" in r] == [2, 4]
    # megatron-core's warnings that are expected on CPU are silenced, and said once instead.
    assert not [name for name, log in logs.items() if "Warning" in log or "Traceback" in log], logs
    train = logs["step4.log"]
    assert train.count("> CPU: gloo process groups, megatron-core's local layer spec") == 1, train


def _readme_default(text: str):
    """A README default cell as a value: `off` is False, numbers (1/64 too) as numbers."""
    text = re.sub(r"\s*\(.*\)$", "", text).strip("` ")
    if text == "off":
        return False
    try:
        return float(Fraction(text))
    except ValueError:
        return text


def test_dilocox_flag_table_matches_the_parser():
    """README's DiLoCoX table names every --dilocox-* flag of pretrain_gpt.py, and the defaults it
    states are the parser's (flags whose default is resolved after parsing are not compared)."""
    from megatron_dilocox.arguments import build_parser

    text = (REPO / "README.md").read_text()
    table = re.search(r"### DiLoCoX\n.*?\| flag \| default \| meaning \|\n\|---\|---\|---\|\n((?:\|[^\n]*\n)+)", text, re.S)
    rows = {}
    for line in table.group(1).splitlines():
        flags_cell, default_cell = (cell.strip() for cell in line.split("|")[1:3])
        names = [name.strip("` ") for name in flags_cell.split(" / ")]
        defaults = default_cell.split(" / ") if len(names) > 1 else [default_cell]
        assert len(defaults) == len(names), line
        rows.update(zip(names, defaults))
    actions = {a.option_strings[0]: a for a in build_parser()._actions
               if a.option_strings and a.option_strings[0].startswith("--dilocox-")}
    assert sorted(rows) == sorted(actions)
    for name, action in actions.items():
        if action.default is None:
            continue
        shown = False if action.nargs == 0 else action.default  # a switch's default is "off"
        assert _readme_default(rows[name]) == shown, name
