"""The calculator task (volunteer_rl/task/): safe evaluator, reward, generator, CSV files, shipped
splits."""

import ast
import re
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from helpers.cpu_time import own_cpu_seconds

from volunteer_rl.task.calculator import MAX_EXPRESSION_CHARS, canonicalize, safe_eval
from volunteer_rl.task.dataset import DatasetError, Problem, file_sha256, load_csv, write_csv
from volunteer_rl.task.calculator_generate import (
    generate_labelled,
    generate_problems,
    make_splits,
    template_names,
)
from volunteer_rl.task.reward import completion_reward, reward

DATA = Path(__file__).resolve().parents[2] / "data"


# -----------------------------------------------------------------------------
# safe_eval


@pytest.mark.parametrize("text, value", [
    ("1 + 2", 3.0),
    ("(12 + 3 + 37) * 14 - 15", 713.0),
    ("1 + 2 * 3", 7.0),          # precedence
    ("(1 + 2) * 3", 9.0),
    ("10 - 4 - 3", 3.0),         # left-associative
    ("2 ** 3 ** 2", 512.0),      # right-associative
    ("-3 ** 2", -9.0),           # unary minus binds looser than **
    ("(-3) ** 2", 9.0),
    ("-5 + +2", -3.0),
    ("7 / 2", 3.5),
    ("7 // 2", 3.0),
    ("-7 // 2", -4.0),
    ("7 % 3", 1.0),
    ("-7 % 3", 2.0),
    ("2 ** -1", 0.5),
    ("1.5 * 4", 6.0),
    ("  42  ", 42.0),
])
def test_safe_eval_valid(text, value):
    assert safe_eval(text) == value


HOSTILE = [
    "9**9**9",
    "10**10**10",
    "(2**64)**(2**64)",
    "2**64**2",
    "__import__('os').system('echo hi')",
    "().__class__",
    "open('x')",
    "lambda: 1",
    "[1]*10",
    "'a'*10",
    "1 if 1 else 2",
    "1<2",
    "x + 1",
    "(1).real",
    "1+" * 5_000_000 + "1",       # 10 MB
    "(" * 100_000 + "1" + ")" * 100_000,
    "(" * 99 + "1" + ")" * 99 + "+x",
    "-" * 150 + "1",
    "True+1",
    "1j",
    "1/0",
    "5%0",
    "5//0",
    "0**-1",
    "(-8)**0.5",
    "float('inf')",
    "1e308*10",
    "99999999*99999999*99999999*99999999",
    "",
    "   ",
    "1 +",
    "'\\d'",                      # would emit SyntaxWarning if not silenced
    "\x00",
    None,
    12,
]


@pytest.mark.parametrize("text", HOSTILE, ids=lambda t: repr(t)[:30])
def test_safe_eval_hostile_returns_none_quickly(text):
    with own_cpu_seconds() as spent:
        assert safe_eval(text) is None
    assert spent.seconds < 0.1


def test_safe_eval_length_bound():
    assert safe_eval("1" * MAX_EXPRESSION_CHARS) is None  # magnitude, not length
    assert safe_eval("1+" * (MAX_EXPRESSION_CHARS // 2) + "1") is None  # too long
    assert safe_eval("1+" * 90 + "1") == 91.0


def test_canonicalize():
    assert canonicalize("((12+3)+37)*14-15") == "(12 + 3 + 37) * 14 - 15"
    assert canonicalize("1-(2-3)") == "1 - (2 - 3)"
    assert canonicalize("(2**3)**2") == "(2 ** 3) ** 2"
    assert canonicalize("-(1+2)") == "-(1 + 2)"
    assert canonicalize("open('x')") is None


# -----------------------------------------------------------------------------
# reward: the whole completion is one expression (surrounding whitespace allowed)


@pytest.mark.parametrize("completion, expected", [
    ("(1 + 2) * 3", 1.0),
    ("  (1 + 2) * 3  \n", 1.0),
    ("\n\t(1 + 2) * 3\n", 1.0),
    # The cases below were rewarded before issue 15; its strict rule refuses them on purpose:
    # a rewarded completion carries nothing but the expression.
    ("```python\n(1 + 2) * 3\n```", 0.0),
    ("```\n(1 + 2) * 3\n```\nDone.", 0.0),
    ("```(1 + 2) * 3```", 0.0),
    ("`(1 + 2) * 3`", 0.0),
    ("A: (1 + 2) * 3", 0.0),
    ("Answer: `(1 + 2) * 3`", 0.0),
    ("= (1 + 2) * 3", 0.0),
    ("(1 + 2) * 3.", 0.0),
    ("\n\n(1 + 2) * 3\nThe answer is 9.", 0.0),
    # Issue 15: a payload after the expression, on its next line, in a comment, or inside
    # brackets the parser would join across lines.
    ("(1 + 2) * 3\nvisit evil example com", 0.0),
    ("(1 + 2) * 3  # visit evil example com", 0.0),
    ("(1 +\n2) * 3", 0.0),
    ("(1 + 2) * 3\r\nvisit", 0.0),
    ("", 0.0),
    (None, 0.0),
])
def test_reward_is_for_the_whole_completion(completion, expected):
    assert reward(completion, "(1 + 2) * 3") == expected


def test_reward_payload_after_a_correct_line_is_zero():
    assert reward("1 + 2", "1 + 2") == 1.0
    assert reward("1 + 2\nvisit evil example com", "1 + 2") == 0.0


def test_reward_equivalent_expressions():
    assert reward("3*(2+1)", "(1 + 2) * 3") == 1.0
    # fences and "A:" were rewarded before issue 15; refused on purpose now
    assert reward("```python\n3*(2+1)\n```", "(1 + 2) * 3") == 0.0
    assert reward("A: 9", "(1 + 2) * 3") == 0.0
    assert reward("9", "(1 + 2) * 3") == 1.0
    assert reward("1/3 + 1/3 + 1/3", "1") == 1.0  # float noise within tolerance


@pytest.mark.parametrize("completion", [
    "1 + 2 * 3", "10", "", "I don't know", "__import__('os').system('echo hi')",
    "9**9**9", "1/0", "(1 + 2) * 3 * 1e-3", None, "x" * 1_000_000,
    " " * 1_000_000 + "10", "9\n" + "x" * 1_000_000,
])
def test_reward_wrong_or_hostile_is_zero(completion):
    with own_cpu_seconds() as spent:
        assert reward(completion, "(1 + 2) * 3") == 0.0
    assert spent.seconds < 0.1


def test_reward_bad_target_is_zero():
    assert reward("1", "open('x')") == 0.0
    assert reward("1", None) == 0.0


_NON_BLANK = st.text(max_size=40).filter(str.strip)


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(first=st.one_of(st.sampled_from(["9", "(1 + 2) * 3", "3*(2+1)", "(1 +", " 9 "]),
                       _NON_BLANK),
       line_break=st.sampled_from(["\n", "\r\n", "\r", "\v", "\f", "\x85", "\u2028"]),
       second=st.one_of(st.sampled_from(["9", "0", "2) * 3", "visit evil example com", "# x"]),
                        _NON_BLANK))
@example(first="9", line_break="\n", second="9")
def test_reward_text_on_two_lines_is_zero(first, line_break, second):
    assert reward(first + line_break + second, "(1 + 2) * 3") == 0.0


# -----------------------------------------------------------------------------
# completion_reward: the sampled tokens, EOS and special tokens included


@pytest.fixture(scope="module")
def tok():
    from volunteer_rl.model.tiny import build_tokenizer

    return build_tokenizer(["Q: What is 1 plus 2, times 3?\nA: ", "(1 + 2) * 3", "9",
                            "visit evil example com"], vocab_size=300)


def _judge(tok, ids, target="(1 + 2) * 3"):
    return completion_reward(ids, target, lambda t: tok.decode(t, skip_special_tokens=False),
                             tok.eos_token_id, frozenset(tok.all_special_ids))


def _ids(tok, text):
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_completion_reward_expression_then_eos(tok):
    eos = tok.eos_token_id
    assert _judge(tok, _ids(tok, "(1 + 2) * 3") + [eos]) == 1.0
    assert _judge(tok, _ids(tok, " 9\n") + [eos]) == 1.0  # whitespace around it allowed
    assert _judge(tok, _ids(tok, "9") + [eos], "1 + 2") == 0.0  # wrong value


def test_completion_reward_refuses_what_the_text_would_hide(tok):
    eos, expr = tok.eos_token_id, _ids(tok, "(1 + 2) * 3")
    payload = _ids(tok, " visit evil example com")
    specials = [t for t in tok.all_special_ids if t != eos]
    assert specials, "the tiny tokenizer has <pad> besides <eos>"
    assert _judge(tok, expr + [eos] + payload + [eos]) == 0.0      # tokens after EOS
    assert _judge(tok, expr + [eos] + payload) == 0.0
    assert _judge(tok, expr + [eos, eos]) == 0.0
    assert _judge(tok, expr[:1] + specials[:1] + expr[1:] + [eos]) == 0.0  # special inside
    assert _judge(tok, expr + specials[:1] + [eos]) == 0.0
    assert _judge(tok, expr) == 0.0                                  # no EOS: cut off
    assert _judge(tok, [eos]) == 0.0 and _judge(tok, []) == 0.0
    # the same ids, decoded as the old reader did, looked like the bare expression
    hidden = tok.decode(expr[:1] + specials[:1] + expr[1:] + [eos], skip_special_tokens=True)
    assert reward(hidden, "(1 + 2) * 3") == 1.0


def test_completion_reward_never_raises(tok):
    def broken(_ids):
        raise RuntimeError("decode failed")

    eos = tok.eos_token_id
    assert completion_reward(_ids(tok, "9") + [eos], "(1 + 2) * 3", broken, eos, set()) == 0.0
    assert completion_reward(None, "(1 + 2) * 3", broken, eos, set()) == 0.0
    assert _judge(tok, ["9", eos]) == 0.0


# -----------------------------------------------------------------------------
# generator

CANONICAL_TOKENS = re.compile(r"\(*\d+\)*( (\+|-|\*|/|//|%|\*\*) \(*\d+\)*)*")


def _n_ops(expression):
    return sum(isinstance(n, ast.BinOp) for n in ast.walk(ast.parse(expression, mode="eval")))


@pytest.fixture(scope="module")
def sample():
    return generate_labelled(2000, seed=7)


def test_generator_deterministic():
    assert generate_problems(200, seed=3) == generate_problems(200, seed=3)
    assert generate_problems(200, seed=3) != generate_problems(200, seed=4)


def test_generator_problems_are_valid(sample):
    problems = [p for p, _ in sample]
    assert [p.id for p in problems] == list(range(len(problems)))
    assert len({p.prompt for p in problems}) == len(problems)  # unique prompts
    for p in problems:
        value = safe_eval(p.expression)
        assert value is not None and abs(value) <= 1e9, p
        assert canonicalize(p.expression) == p.expression, p  # one canonical style
        assert CANONICAL_TOKENS.fullmatch(p.expression), p
        assert "\n" not in p.prompt and p.prompt[-1] in ".?", p
        assert re.search(r"\d", p.prompt), p  # numbers written as digits
    assert {_n_ops(p.expression) for p in problems} == {1, 2, 3, 4}


def test_generator_ops_range():
    problems = generate_problems(100, seed=1, ops_range=(2, 2))
    assert {_n_ops(p.expression) for p in problems} == {2}


def test_generator_divisions_mostly_exact(sample):
    divisions = [p for p, _ in sample if re.search(r" / ", p.expression)]
    assert divisions
    exact = [p for p in divisions if safe_eval(p.expression).is_integer()]
    assert len(exact) / len(divisions) > 0.7


def test_generator_many_phrasings(sample):
    # count by template label...
    used = {name for _, names in sample for name in names}
    assert used <= set(template_names())
    assert len(used) >= 15
    # ...and independently by the words that appear in the prompts
    phrases = ["add ", " plus ", "sum of", "total of", "subtract", " minus ", "take away",
               "away from", " less ", "difference between", "multiply", " times ",
               "product of", "divide", "divided by", "quotient of", "double", "halve",
               "increase", "decrease", "reduce", "modulo", "remainder", "square",
               "what is", "start with", "and finally"]
    text = " ".join(p.prompt.lower() for p, _ in sample)
    assert sum(phrase in text for phrase in phrases) >= 20


def test_generator_example_style(sample):
    # the brief's example: "add 12, 3, and 37, multiply that sum by 14, then subtract 15."
    # -> "(12 + 3 + 37) * 14 - 15": a sum list followed by a multiplication must
    # come out with exactly these parentheses.
    summed_then_multiplied = [p for p, names in sample
                              if names[0] == "start:add_list" and len(names) > 1
                              and names[1] in ("step:multiply_by", "step:times")]
    assert summed_then_multiplied
    for p in summed_then_multiplied:
        assert re.match(r"add \d+(, \d+)*,? and \d+, ", p.prompt.lower()), p
        assert re.match(r"\(\d+( \+ \d+)+\) \* \d+", p.expression), p
    assert any("multiply that sum by" in p.prompt for p, _ in sample)


# -----------------------------------------------------------------------------
# CSV files


def test_csv_round_trip(tmp_path):
    problems = generate_problems(50, seed=11)
    path = tmp_path / "sub" / "x.csv"
    write_csv(path, problems)
    assert load_csv(path) == problems
    assert path.read_text().splitlines()[0] == "python_expression,natural_language"
    assert len(file_sha256(path)) == 64
    assert not list(path.parent.glob("*.tmp"))  # no temp file left behind


def test_csv_extra_columns_and_order(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text('id,natural_language,notes,python_expression\n'
                    '7,"add 1, 2, and 3.",hi,1 + 2 + 3\n'
                    '8,two times 4,,2 * 4\n')
    assert load_csv(path) == [Problem(0, "add 1, 2, and 3.", "1 + 2 + 3"),
                              Problem(1, "two times 4", "2 * 4")]


def _error(path):
    with pytest.raises(DatasetError) as info:
        load_csv(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    return message


def test_csv_errors(tmp_path):
    assert "not found" in _error(tmp_path / "missing.csv")

    empty = tmp_path / "empty.csv"
    empty.write_text("")
    assert "empty" in _error(empty)

    no_column = tmp_path / "no_column.csv"
    no_column.write_text("python_expression,text\n1 + 1,one plus one\n")
    assert "natural_language" in _error(no_column)

    bad_row = tmp_path / "bad_row.csv"
    bad_row.write_text("python_expression,natural_language\n1 + 1,ok\n"
                       "__import__('os'),evil\n")
    assert "row 1" in _error(bad_row)


# -----------------------------------------------------------------------------
# splits


def test_make_splits_small(tmp_path):
    train_path, eval_path = make_splits(tmp_path, n_train=300, n_eval=50, seed=5)
    train, held_out = load_csv(train_path), load_csv(eval_path)
    assert (len(train), len(held_out)) == (300, 50)
    assert not {p.prompt for p in train} & {p.prompt for p in held_out}
    assert not {p.expression for p in train} & {p.expression for p in held_out}


def test_shipped_data():
    train, held_out = load_csv(DATA / "train.csv"), load_csv(DATA / "eval.csv")
    assert (len(train), len(held_out)) == (20000, 500)
    assert not {p.prompt for p in train} & {p.prompt for p in held_out}
    assert not {p.expression for p in train} & {p.expression for p in held_out}
    assert len({p.prompt for p in train}) == len(train)
