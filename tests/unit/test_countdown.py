"""The countdown task (volunteer_rl/task/countdown.py): the reward's rule, check, prompt and
stratum, the row generator (task/countdown_generate.py), the shipped CSVs and the generator's
command line."""

import ast
import csv
import hashlib
import subprocess
import sys
from fractions import Fraction
from itertools import combinations
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from helpers.cpu_time import own_cpu_seconds

from volunteer_rl.config import PACKAGE_DATA
from volunteer_rl.task import countdown_generate as gen
from volunteer_rl.task.base import Row, Task, completion_reward
from volunteer_rl.task.calculator import render
from volunteer_rl.task.countdown import (
    NEAR_MISS_REWARD,
    CountdownTask,
    judge,
    parse_numbers,
    parse_target,
    score,
)

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data"
TRAIN, EVAL = DATA / "countdown-train.csv", DATA / "countdown-eval.csv"
TASK = CountdownTask()


def row(numbers: str, target: str, solution: str = "", i: int = 0) -> Row:
    return Row(i, {"numbers": numbers, "target": target, "solution": solution})


def shipped(path: Path) -> list[Row]:
    with open(path, newline="", encoding="utf-8") as f:
        return [Row(i, {k: v.strip() for k, v in r.items()})
                for i, r in enumerate(csv.DictReader(f))]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -----------------------------------------------------------------------------
# The reward's rule

R46 = row("3 7 25", "46", "25 + 7 * 3")  # one answer up to order
R24 = row("2 3 4 6", "24", "6 * 4")  # many answers
R9 = row("2 3 7", "9", "7 + 2")


@pytest.mark.parametrize("r, completion", [
    (R46, "25 + 7 * 3"),
    (R46, "3 * 7 + 25"),
    (R46, "(7 * 3) + 25"),
    (R46, "((25)) + (7 * 3)"),
    (R46, "25+7*3"),
    (R46, "  25 + 7 * 3 \n"),  # whitespace around the expression only
    # answers the reference does not use
    (R24, "6 * 4"),
    (R24, "2 * 3 * 4"),
    (R24, "(2 + 6) * 3"),
    (R24, "(3 - 2) * 4 * 6"),
    (R24, "2 * 6 + 3 * 4"),
    (R24, "6 * 3 + 4 + 2"),
    (R24, "(6 + 2) * 3"),
    (R9, "7 + 2"),
    (R9, "2 + 7"),
    # fractions on the way: '/' is true division
    (row("3 3 8 8", "24"), "8 / (3 - 8 / 3)"),
    (row("1 5 5 5", "24"), "(5 - 1 / 5) * 5"),
    (row("1 3 4 6", "24"), "6 / (1 - 3 / 4)"),
    # a number given twice may be used twice
    (row("5 5 9", "19"), "5 + 5 + 9"),
])
def test_right_answers_score_one(r, completion):
    assert TASK.reward(completion, r) == 1.0
    assert TASK.correct(completion, r)


@pytest.mark.parametrize("r, completion", [
    (R46, "25 + 7 + 7 + 7"),  # 7 is given once
    (R46, "40 + 6"),  # neither is given
    (R46, "46"),  # the target itself is not given
    (R46, "25 + 21"),  # 21 is not given, though 7 * 3 makes it
    (R46, "25 + 7 + 3"),  # 35
    (R46, "25 + 7 * 3 = 46"),
    (R46, "25 + 7 * 3 is the answer"),
    (R46, "25 + 7 * 3."),
    (R46, "25 + 7 * 3,"),
    (R46, "25 + 7 * 3\n25 + 7 * 3"),
    (R46, "(25 +\n 7 * 3)"),  # one expression to Python, two lines to us
    (R46, "25 + 7 * 3  # done"),
    (R46, "```\n25 + 7 * 3\n```"),
    (R46, "`25 + 7 * 3`"),
    (R46, "A: 25 + 7 * 3"),
    (R46, "Answer: 25 + 7 * 3"),
    (R46, "25 + 7 × 3"),
    (R46, "25 +\t7 * 3"),
    (R46, "25.0 + 7 * 3"),
    (R46, "0x19 + 7 * 3"),  # 0x19 == 25 to Python
    (R46, "2_5 + 7 * 3"),  # 2_5 == 25 to Python
    (R46, "025 + 7 * 3"),
    (R46, "２５ + 7 * 3"),  # fullwidth digits
    (R46, "25 + 7 * 3j"),
    (R46, "[25 + 7 * 3]"),
    (R46, "(25 + 7 * 3,)"),
    (R46, "()"),
    (R46, ""),
    (R46, "   \n "),
    (R9, "3 ** 2"),
    (R9, "7 // 2 * 3"),
    (R9, "7 + 2 % 3"),
    (R9, "7 - -2"),  # unary minus
    (R9, "+7 + 2"),  # unary plus
    (R9, "2 - -7"),
    (row("3 3 7", "9"), "7 / (3 - 3)"),  # division by zero
    (R9, "abs(7) + 2"),
    (R9, "__import__('os')"),
])
def test_wrong_or_malformed_scores_zero(r, completion):
    assert TASK.reward(completion, r) == 0.0
    assert not TASK.correct(completion, r)


def test_reasons():
    numbers, target = (3, 7, 25), 46
    assert judge("25 + 7 * 3", numbers, target) == (1.0, "")
    assert judge("25 + 7 + 7 + 7", numbers, target)[1] == "uses 7 more often than given"
    assert judge("40 + 6", numbers, target)[1] == "uses 6, which is not given"
    assert judge("25 + 7 + 3", numbers, target) == (NEAR_MISS_REWARD, "equals 35, not 46")
    assert judge("3 ** 7", numbers, target)[1] == "uses an operator other than + - * /"
    assert judge("-3", numbers, target)[1].startswith("uses something other than")


def test_no_partial_reward():
    """The design's choice (NEAR_MISS_REWARD's docstring): a well-formed answer from the given
    numbers that misses earns nothing, the cheapest such answer (one given number) included."""
    assert NEAR_MISS_REWARD == 0.0
    assert TASK.reward("25", R46) == TASK.reward("25 + 7 + 3", R46) == 0.0


HOSTILE = [
    "9" * 10**6,
    "1+" * 10**6 + "1",
    "(" * 10**5 + "7 + 2" + ")" * 10**5,
    "(" * 99 + "7" + ")" * 99,
    "(" * 198 + ")" * 198,
    "7 + 2" + " " * 10**6 + "+ 0",
    " " * 10**6 + "7 + 2",  # right: whitespace around the answer is stripped
    "9**9**9**9",
    "99999999999999999999 * 99999999999999999999",
    "7" * 199,
    "-" * 150 + "7",
    "\x00",
    "7 + 2\x00",
    "\ud800",
    "7 + 2\u2028",  # right: str.strip takes the line separator too, as the calculator's does
    "7 + 2\u2029" + "3",
]


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_text_is_judged_quickly(text):
    with own_cpu_seconds() as spent:
        value = TASK.reward(text, R9)
    assert spent.seconds < 0.2
    assert value == (1.0 if text.strip() == "7 + 2" else 0.0)


def test_deep_parentheses_within_the_bound_are_fine():
    """Parentheses carry nothing: a right answer wrapped in 90 pairs (190 characters) is still
    one expression; past 200 characters (calculator.MAX_EXPRESSION_CHARS) nothing is read."""
    assert TASK.reward("(" * 90 + "7 + 2" + ")" * 90, R9) == 1.0
    assert TASK.reward("(" * 100 + "7 + 2" + ")" * 100, R9) == 0.0


def test_completion_reward_needs_eos():
    """vrl's rule around the task's: the text before a final EOS, nothing else."""
    vocab = {1: "7", 2: " +", 3: " 2", 9: "<eos>", 8: "<pad>"}

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    special = {8, 9}
    assert completion_reward(TASK, R9, [1, 2, 3, 9], decode, 9, special) == 1.0
    assert completion_reward(TASK, R9, [1, 2, 3], decode, 9, special) == 0.0  # cut off
    assert completion_reward(TASK, R9, [1, 2, 3, 9, 1, 9], decode, 9, special) == 0.0
    assert completion_reward(TASK, R9, [1, 8, 2, 3, 9], decode, 9, special) == 0.0


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=300))
@example("7 + 2")
@example("7+2+3")
def test_reward_never_raises_on_any_text(text):
    assert TASK.reward(text, R9) in {0.0, NEAR_MISS_REWARD, 1.0}


_LEAF = st.sampled_from(["2", "3", "4", "6", "1", "24", "06", "6.0"])
_EXPRESSION = st.recursive(_LEAF, lambda inner: st.one_of(
    st.builds(lambda a, op, b, space, paren: (f"({a}{space}{op}{space}{b})" if paren
                                              else f"{a}{space}{op}{space}{b}"),
              inner, st.sampled_from(["+", "-", "*", "/", "**", "//", "%"]), inner,
              st.sampled_from(["", " ", "  "]), st.booleans()),
    st.builds(lambda sign, a: f"{sign}{a}", st.sampled_from(["-", "+"]), inner)),
    max_leaves=6)


@settings(max_examples=1500, deadline=None)
@given(st.one_of(_EXPRESSION, st.text(alphabet="0123456789+-*/() ", max_size=40)))
@example("8 / (3 - 8 / 3)")
def test_reward_matches_an_exact_oracle(text):
    """Against an independent oracle (exact Fractions, the literals counted by hand): with
    numbers 2 3 4 6 and the text's own value as the target (when it is one), the rule says
    right exactly when the text is + - * / over allowed numbers; with target 24, exactly
    when it also makes 24. The strategy writes unary signs, ** // %, floats, leading zeros."""
    numbers = (2, 3, 4, 6)
    exact = _exact(text)
    allowed = exact is not None and not any(
        _literals(text).count(n) > numbers.count(n) for n in _literals(text))
    assert score(text, numbers, 24) == (1.0 if allowed and exact == 24 else 0.0)
    if exact is not None and exact.denominator == 1 and 1 <= exact <= 999:
        assert score(text, numbers, int(exact)) == (1.0 if allowed else 0.0)
    assert score(text, (3, 3, 8, 8), 24) in {0.0, NEAR_MISS_REWARD, 1.0}


def _literals(text: str) -> list[int]:
    return [n.value for n in ast.walk(ast.parse(text.strip(), mode="eval"))
            if isinstance(n, ast.Constant)]


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=30), st.text(max_size=10), st.text(max_size=30), st.text(max_size=30))
def test_reward_never_raises_on_any_row(numbers, target, solution, text):
    r = row(numbers, target, solution)
    assert TASK.reward(text, r) in {0.0, NEAR_MISS_REWARD, 1.0}
    assert TASK.check(r) is None or isinstance(TASK.check(r), str)


def _exact(text: str) -> Fraction | None:
    """The exact value of text if it is an expression of int literals and + - * / only."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.BinOp):
            a, b = value(node.left), value(node.right)
            if a is None or b is None:
                return None
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.Mult):
                return a * b
            if isinstance(node.op, ast.Div):
                return a / b if b else None
        return None

    try:
        return value(tree)
    except RecursionError:
        return None


def _every_expression(numbers: tuple[int, ...]):
    """(tree, exact value) of every expression that uses each of `numbers` once."""
    if len(numbers) == 1:
        yield ast.Constant(numbers[0]), Fraction(numbers[0])
        return
    idx = range(len(numbers))
    for size in range(1, len(numbers)):
        for left in combinations(idx, size):
            right = [i for i in idx if i not in left]
            for ta, a in _every_expression(tuple(numbers[i] for i in left)):
                for tb, b in _every_expression(tuple(numbers[i] for i in right)):
                    for op, v in ((ast.Add(), a + b), (ast.Sub(), a - b), (ast.Mult(), a * b),
                                  (ast.Div(), a / b if b else None)):
                        if v is not None:
                            yield ast.BinOp(left=ta, op=op, right=tb), v


@pytest.mark.parametrize("numbers", [
    (3, 3, 8, 8), (1, 5, 5, 5), (97, 98, 99, 100), (7, 11, 13, 100), (1, 2, 3, 4),
    (3, 7, 25), (9, 15, 18, 18),
])
def test_rule_agrees_with_exact_arithmetic(numbers):
    """Every expression over every subset of the numbers: the float rule (safe_eval and
    isclose) counts it right for an integer target exactly when its exact value is that
    target. Values on the way may be fractions, negative or large (100**4)."""
    seen = 0
    for size in range(1, len(numbers) + 1):
        for subset in set(combinations(numbers, size)):
            for tree, v in _every_expression(subset):
                text = render(tree)
                seen += 1
                for target in {int(v), int(v) + 1, int(v) - 1}:
                    if 1 <= target <= 999:
                        assert score(text, numbers, target) == (1.0 if v == target else 0.0), \
                            (text, v, target)
    assert seen > (1000 if len(numbers) == 4 else 200)


# -----------------------------------------------------------------------------
# check, prompt, stratum, the task's settings


def test_check_accepts_a_right_row():
    assert TASK.check(R46) is None
    assert TASK.check(row("3 3 8 8", "24", "8 / (3 - 8 / 3)")) is None
    assert TASK.check(row("1 2 3 4 5 100", "999", "100 * (5 + 4 + 1) - 3 + 2")) is None


@pytest.mark.parametrize("r, words", [
    (row("3 7 25", "46", "25 + 7 + 3"), "equals 35, not 46"),
    (row("3 7 25", "46", "25 + 21"), "uses 21, which is not given"),
    (row("3 7 25", "46", "25 + 7 + 7 + 7"), "uses 7 more often than given"),
    (row("3 7 25", "46", ""), "solution '' is no answer"),
    (row("3 7 25", "46", "25 + 7 * 3 # ok"), "solution"),
    (row("7", "7", "7"), "numbers '7' is not 2 to 6 whole numbers"),
    (row("1 2 3 4 5 6 7", "28", "1 + 2"), "numbers"),
    (row("0 3 7", "10", "3 + 7"), "numbers"),
    (row("3 7 101", "10", "3 + 7"), "numbers"),
    (row("03 7 25", "10", "3 + 7"), "numbers"),
    (row("3,7,25", "10", "3 + 7"), "numbers"),
    (row("3 7 x", "10", "3 + 7"), "numbers"),
    (row("3 7 25", "46.0", "25 + 7 * 3"), "target '46.0' is not a whole number from 1 to 999"),
    (row("3 7 25", "-4", "3 - 7"), "target"),
    (row("3 7 25", "0", "3 - 3"), "target"),
    (row("3 7 25", "1000", "3 + 7"), "target"),
    (row("3 7 25", "x", "3 + 7"), "target"),
])
def test_check_refuses_a_bad_row(r, words):
    why = TASK.check(r)
    assert why is not None and words in why and "\n" not in why


def test_parsers():
    assert parse_numbers("3 7  25") == (3, 7, 25)
    assert parse_numbers(" 3 7 ") == (3, 7)
    assert parse_numbers("100 1") == (100, 1)
    assert parse_numbers("3") is None and parse_numbers("+3 7") is None
    assert parse_target("46") == 46 and parse_target("999") == 999
    assert parse_target("046") is None and parse_target("1e2") is None


def test_prompt_and_reference():
    assert TASK.prompt(R46) == "numbers 3 7 25, target 46"
    assert TASK.prompt(row(" 3  7 25", "46")) == "numbers 3 7 25, target 46"
    assert TASK.reference(R46) == "25 + 7 * 3"
    assert "{question}" in TASK.instruction and len(TASK.instruction) < 600


def test_stratum():
    assert TASK.stratum(row("3 7", "10", "7 + 3")) == 1
    assert TASK.stratum(R46) == 2
    assert TASK.stratum(row("1 2 3 4", "10", "(1 + 2) * 3 + 4")) == 3


def test_task_settings_and_registry():
    from volunteer_rl.task.registry import load

    assert isinstance(TASK, Task)
    assert TASK.name == "countdown"
    assert TASK.columns == ("numbers", "target", "solution")
    assert TASK.k == 8 and 0 < TASK.reward_seconds <= 1 and 0 < TASK.reward_memory_mb <= 256
    assert TASK.data() == (PACKAGE_DATA / "countdown-train.csv",
                           PACKAGE_DATA / "countdown-eval.csv")
    loaded, info = load("countdown")
    assert isinstance(loaded, CountdownTask) and info.name == "countdown"


# -----------------------------------------------------------------------------
# The generator


def test_generator_is_deterministic():
    a, b = gen.generate_rows(60, seed=5), gen.generate_rows(60, seed=5)
    assert a == b
    assert a != gen.generate_rows(60, seed=6)
    assert len({r.key for r in a}) == 60


def test_generator_rows_follow_the_recipe():
    rows = gen.generate_rows(300, seed=7)
    for r in rows:
        assert len(r.numbers) in gen.COUNTS and list(r.numbers) == sorted(r.numbers)
        assert all(gen.LOW <= n <= gen.HIGH for n in r.numbers)
        assert gen.TARGET_LOW <= r.target <= gen.TARGET_HIGH
        assert score(r.solution, r.numbers, r.target) == 1.0
        ops = TASK.stratum(row(" ".join(map(str, r.numbers)), str(r.target), r.solution))
        # no answer with fewer operations than the reference exists
        assert gen.fewest_operations(r.numbers, r.target, most=ops) == ops
    assert {TASK.stratum(row("1 1", "1", r.solution)) for r in rows} == {1, 2, 3}


def test_fewest_operations():
    assert gen.fewest_operations((3, 7, 25), 7) == 0
    assert gen.fewest_operations((3, 7, 25), 10) == 1
    assert gen.fewest_operations((3, 7, 25), 46) == 2
    assert gen.fewest_operations((3, 3, 8, 8), 24) == 1  # 3 * 8: a subset will do
    assert gen.fewest_operations((13, 20, 21, 25), 79) == 3  # 21 + 20 + 25 + 13
    assert gen.fewest_operations((13, 20, 21, 25), 79, most=2) is None
    assert gen.fewest_operations((1, 3, 3, 7), 9) == 1  # with a fraction: 3 * 3
    assert gen.fewest_operations((1, 5, 5, 5), 24) == 2  # 5 * 5 - 1
    assert gen.fewest_operations((1, 2), 99) is None


def test_make_splits_small_is_disjoint(tmp_path):
    train_path, eval_path = gen.make_splits(tmp_path, n_train=400, n_eval=60, seed=3)
    train, held_out = shipped(train_path), shipped(eval_path)
    assert (len(train), len(held_out)) == (400, 60)
    keys = [{(tuple(sorted(r["numbers"].split())), r["target"]) for r in rows}
            for rows in (train, held_out)]
    assert not keys[0] & keys[1]
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically: no temporary left


# -----------------------------------------------------------------------------
# The shipped files


def test_shipped_files_load_and_every_reference_scores_one():
    train, held_out = shipped(TRAIN), shipped(EVAL)
    assert (len(train), len(held_out)) == (20000, 500)
    with open(TRAIN, encoding="utf-8") as f:
        assert f.readline() == "numbers,target,solution\n"
    for r in train + held_out:
        assert TASK.check(r) is None, (r.id, TASK.check(r))
        assert TASK.reward(TASK.reference(r), r) == 1.0
        assert 1 <= TASK.stratum(r) <= 3
    keys = [[(tuple(sorted(map(int, r["numbers"].split()))), int(r["target"])) for r in rows]
            for rows in (train, held_out)]
    assert len(set(keys[0])) == len(keys[0]) and len(set(keys[1])) == len(keys[1])
    assert not set(keys[0]) & set(keys[1])


def test_shipped_eval_strata_are_the_fewest_operations():
    for r in shipped(EVAL)[:200]:
        numbers, ops = parse_numbers(r["numbers"]), TASK.stratum(r)
        assert gen.fewest_operations(numbers, int(r["target"]), most=ops) == ops, r


def test_tiny_tokenizer_fits_max_new_tokens():
    """The tiny model's BPE, trained like the trainer trains it (prompts and references):
    the longest reference and its EOS fit in max_new_tokens, and a prompt plus that many
    tokens in the tiny model's 256 positions."""
    pytest.importorskip("tokenizers")
    from volunteer_rl.model.tiny import build_tokenizer

    train = shipped(TRAIN)
    prompts = [TASK.prompt(r) for r in train]
    references = [TASK.reference(r) for r in train]
    tok = build_tokenizer(prompts + references)
    longest = max(len(tok(text, add_special_tokens=False)["input_ids"]) for text in references)
    longest_prompt = max(len(tok(f"Q: {p}\nA: ", add_special_tokens=False)["input_ids"])
                         for p in prompts)
    assert longest + 1 <= TASK.max_new_tokens
    assert longest_prompt + TASK.max_new_tokens <= 256


def _run_generate(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "volunteer_rl.task.generate", *args], cwd=REPO,
                   check=True, capture_output=True, timeout=600)


def test_generate_command_reproduces_the_shipped_countdown_files(tmp_path):
    _run_generate("--task", "countdown", "--out", str(tmp_path))
    for name in ("countdown-train.csv", "countdown-eval.csv"):
        assert sha256(tmp_path / name) == sha256(DATA / name), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["countdown-eval.csv",
                                                          "countdown-train.csv"]


def test_generate_command_still_makes_the_calculator_files(tmp_path):
    """--task calculator is the default and makes what it made before --task existed."""
    _run_generate("--out", str(tmp_path / "default"))
    _run_generate("--task", "calculator", "--out", str(tmp_path / "calculator"))
    for folder in ("default", "calculator"):
        assert sorted(p.name for p in (tmp_path / folder).iterdir()) == ["eval.csv", "train.csv"]
        for name in ("train.csv", "eval.csv"):
            assert sha256(tmp_path / folder / name) == sha256(DATA / name), (folder, name)
