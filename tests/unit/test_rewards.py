"""Rule rewards (gsm8k strict/flexible, arithmetic), custom functions, penalties, batch scoring."""

import textwrap

import pytest
import torch

from hybridrl.rewards import REWARD_FNS, Registry, RewardScorer, arithmetic, gsm8k, load_reward_fn
from hybridrl.rewards.penalties import length_fraction, repetition_fraction
from hybridrl.rewards.scoring import RewardFunctionError

STRICT_CASES = [
    ("The answer is\n#### 72", "72", 1.0),
    ("#### 1,200", "1200", 1.0),  # "," stripped
    ("#### $5", "5", 0.0),  # "$" is not in the number pattern, so no "#### <number>" match
    ("#### 5$", "5", 1.0),  # "5" matched; "$" after it is not part of the match
    ("#### 3\nwait, recount\n#### 4", "4", 1.0),  # last match wins
    ("#### 3\nwait, recount\n#### 4", "3", 0.0),
    ("answer: 72", "72", 0.0),  # no "#### "
    ("####72", "72", 0.0),  # the space is required
    ("#### -3.50", "-3.5", 0.0),  # exact string match, no numeric equality
    ("#### -3.50", "-3.50", 1.0),
    ("#### 8" + "x" * 300, "8", 0.0),  # outside the last 300 characters
    ("#### 8" + "x" * 294, "8", 1.0),  # 6 + 294 = 300 characters: inside
]


@pytest.mark.parametrize("text,truth,expected", STRICT_CASES)
def test_gsm8k_strict(text, truth, expected):
    assert gsm8k.compute_score("openai/gsm8k", text, truth) == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so 3 apples and then 7 more make 10.", "10."),  # verbatim: the trailing "." stays
        ("total 1,234", "1,234"),  # nothing stripped in flexible mode
        ("costs 5 dollars.", "5"),  # last match is "." -> skipped, then "5"
        ("no digits here", None),
        ("#### 12 and then -4", "-4"),
    ],
)
def test_gsm8k_flexible_extraction(text, expected):
    assert gsm8k.extract_answer(text, "flexible") == expected


def test_gsm8k_flexible_scoring_and_format_score():
    assert gsm8k.compute_score("gsm8k", "I get 42", "42", method="flexible") == 1.0
    assert gsm8k.compute_score("gsm8k", "I get 42", "42") == 0.0  # strict needs ####
    assert gsm8k.compute_score("gsm8k", "#### 41", "42", format_score=0.1) == 0.1
    assert gsm8k.compute_score("gsm8k", "none", "42", format_score=0.1) == 0.0
    with pytest.raises(ValueError, match="method='loose'"):
        gsm8k.extract_answer("1", "loose")


def test_arithmetic_reward():
    assert arithmetic.compute_score("a", "12 + 30 = 42\n#### 42", "42") == 1.0
    assert arithmetic.compute_score("a", "#### 042", "42") == 1.0  # integer comparison
    assert arithmetic.compute_score("a", "#### 41", "42") == 0.0
    assert arithmetic.compute_score("a", "#### 41", "42", format_score=0.1) == 0.1
    assert arithmetic.compute_score("a", "42", "42", format_score=0.1) == 0.0
    assert arithmetic.compute_score("a", "#### 1 then #### -7", "-7") == 1.0
    with pytest.raises(ValueError, match="not an integer"):
        arithmetic.compute_score("a", "#### 1", "one")


def test_registry():
    reg = Registry("thing")
    reg.register("a", len)

    @reg.register("b")
    def b():
        return 1

    assert reg.get("a") is len and reg.get("b") is b and reg.names() == ["a", "b"]
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a", max)
    reg.register("a", max, override=True)
    assert reg.get("a") is max
    with pytest.raises(ValueError, match=r"unknown thing 'c'.*\['a', 'b'\]"):
        reg.get("c")
    assert {"openai/gsm8k", "gsm8k", "hybridrl/arithmetic"} <= set(REWARD_FNS.names())


def test_dispatch_by_data_source_and_fn_kwargs():
    scorer = RewardScorer(fn_kwargs={"openai/gsm8k": {"method": "flexible"}})
    scores, m = scorer.score_batch(
        ["it is 72", "#### 9", "#### 3"],
        ["72", "9", "4"],
        ["openai/gsm8k", "hybridrl/arithmetic", "hybridrl/arithmetic"],
    )
    assert scores.tolist() == [1.0, 1.0, 0.0]
    assert m["reward/source/hybridrl/arithmetic/mean"] == 0.5
    # mid-run, a failing reward lookup is a training failure naming the row and its source
    with pytest.raises(RewardFunctionError, match="unknown reward function.*'mystery'.*row 0"):
        RewardScorer().score_batch(["x"], ["1"], ["mystery"])


def test_custom_function_by_import_path(tmp_path, monkeypatch):
    module = tmp_path / "my_reward_mod.py"
    module.write_text(
        textwrap.dedent("""
        def as_float(data_source, solution_str, ground_truth, extra_info, bonus=0.0):
            return float(solution_str == ground_truth) + bonus + extra_info["w"]

        def as_dict(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": 2.0, "acc": float(solution_str == ground_truth), "tag": "x"}

        def bad(data_source, solution_str, ground_truth, extra_info=None):
            return "oops"
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward_fn("my_reward_mod:as_float")
    assert fn("s", "a", "a", {"w": 0.5}) == 1.5
    scorer = RewardScorer(custom_fn="my_reward_mod:as_float", custom_fn_kwargs={"bonus": 1.0})
    scores, _ = scorer.score_batch(["a", "b"], ["a", "a"], ["any", "thing"], [{"w": 0}, {"w": 0}])
    assert scores.tolist() == [2.0, 1.0]  # 1 + 1 bonus, 0 + 1 bonus
    by_file = RewardScorer(custom_fn=f"{module}:as_dict")
    scores, m = by_file.score_batch(["a", "b"], ["a", "a"], ["s", "s"])
    assert (
        scores.tolist() == [2.0, 2.0] and m["reward/acc/mean"] == 0.5 and "reward/tag/mean" not in m
    )
    with pytest.raises(RewardFunctionError) as err:  # its own line, not "raised ValueError: ..."
        RewardScorer(custom_fn="my_reward_mod:bad").score_batch(["a"], ["a"], ["s"])
    assert str(err.value).startswith("reward function 'my_reward_mod:bad' returned str; allowed")
    assert str(err.value).endswith(" on row 0 (data_source 's', index None)")
    # a signature verl's call cannot bind: ValueError when the scorer is built, not on row 0
    with pytest.raises(ValueError, match=r"reward function 'my_reward_mod:as_dict' cannot be "
                       r"called as fn\(data_source, solution_str, ground_truth, extra_info, "
                       r"bonus=...\) .*unexpected keyword argument 'bonus'"):
        RewardScorer(custom_fn="my_reward_mod:as_dict", custom_fn_kwargs={"bonus": 1.0})
    # user code raising anything: one line naming the function, the row, data_source and index
    with pytest.raises(RewardFunctionError, match=(
            r"reward function 'my_reward_mod:as_float' raised KeyError: 'w' on row 1 "
            r"\(data_source 'src_b', index 7\)")):
        RewardScorer(custom_fn="my_reward_mod:as_float").score_batch(
            ["a", "b"], ["a", "a"], ["src_a", "src_b"], [{"w": 0}, {"index": 7}])
    for spec, msg in [
        ("no_colon", "allowed forms"),
        ("my_reward_mod:missing", "no callable 'missing'"),
        ("not_a_module_xyz:f", "cannot import"),
        (f"{tmp_path}/absent.py:f", "does not exist"),
    ]:
        with pytest.raises(ValueError, match=msg):
            load_reward_fn(spec)


def test_penalties():
    assert length_fraction(30, 120) == 0.25 and length_fraction(500, 120) == 1.0
    # ids 1 2 1 2 1 2: trigrams (1,2,1) (2,1,2) (1,2,1) (2,1,2) -> 2 distinct of 4 -> 0.5 repeated
    assert repetition_fraction([1, 2, 1, 2, 1, 2], 3) == 0.5
    assert repetition_fraction([1, 2, 3, 4], 3) == 0.0
    assert repetition_fraction([1, 1], 3) == 0.0  # fewer tokens than n
    scorer = RewardScorer(length_penalty=True, repetition_penalty=True)
    ids = [[1, 2, 1, 2, 1, 2], [5, 6, 7]]
    scores, m = scorer.score_batch(
        ["#### 3", "#### 4"],
        ["3", "3"],
        ["hybridrl/arithmetic"] * 2,
        response_ids=ids,
        max_response_length=12,
    )
    # row 0: 1.0 - 0.05 * 6/12 - 0.05 * 0.5 = 0.95; row 1: 0.0 - 0.05 * 3/12 - 0 = -0.0125
    assert scores.tolist() == pytest.approx([0.95, -0.0125])
    assert m["critic/score/mean"] == pytest.approx((0.95 - 0.0125) / 2)
    assert m["critic/score/max"] == pytest.approx(0.95) and m["reward/raw_score/mean"] == 0.5
    assert m["reward/length_penalty/mean"] == pytest.approx(-0.05 * (0.5 + 0.25) / 2)
    with pytest.raises(ValueError, match="max_response_length"):
        scorer.score_batch(["#### 3"], ["3"], ["gsm8k"], response_ids=[[1]])
    with pytest.raises(ValueError, match="response_ids"):
        scorer.score_batch(["#### 3"], ["3"], ["gsm8k"])


def test_score_tokens_decodes_masked_ids():
    from hybridrl.data.tokenizer import CharTokenizer

    tok = CharTokenizer()
    rows = ["#### 12", "#### 9"]
    width = 10
    ids = torch.zeros(2, width, dtype=torch.long)  # pad 0
    mask = torch.zeros(2, width, dtype=torch.long)
    for b, text in enumerate(rows):
        enc = tok.encode(text) + [tok.eos_token_id]
        ids[b, : len(enc)] = torch.tensor(enc)
        mask[b, : len(enc)] = 1
    scorer = RewardScorer(length_penalty=True)
    scores, _ = scorer.score_tokens(tok, ids, mask, ["12", "8"], ["hybridrl/arithmetic"] * 2)
    # row 0: correct, 8 tokens (7 chars + eos) of R=10 -> 1 - 0.05 * 0.8 = 0.96
    # row 1: wrong, 7 tokens -> 0 - 0.05 * 0.7 = -0.035
    assert scores.tolist() == pytest.approx([0.96, -0.035])
    # the configured limit (rollout.response_length = 40), not the batch width, is the divisor:
    # row 0: 1 - 0.05 * 8/40 = 0.99; row 1: -0.05 * 7/40 = -0.00875
    scores, _ = scorer.score_tokens(tok, ids, mask, ["12", "8"], ["hybridrl/arithmetic"] * 2,
                                    max_response_length=40)
    assert scores.tolist() == pytest.approx([0.99, -0.00875])


def test_build_reward_scorer_from_config():
    config = pytest.importorskip("hybridrl.config")
    from hybridrl.rewards import build_reward_scorer

    cfg = config.RewardConfig(gsm8k_method="flexible", format_score=0.1, use_length_penalty=True)
    scorer = build_reward_scorer(cfg)
    scores, _ = scorer.score_batch(
        ["it is 72", "#### 5", "#### 4"],
        ["72", "4", "4"],
        ["openai/gsm8k", "hybridrl/arithmetic", "hybridrl/arithmetic"],
        response_ids=[[1] * 4, [1] * 8, [1] * 2],
        max_response_length=8,
    )
    # flexible finds 72: 1 - 0.05 * 4/8; wrong arithmetic: 0.1 - 0.05 * 1; right: 1 - 0.05 * 2/8
    assert scores.tolist() == pytest.approx([0.975, 0.05, 0.9875])
    assert build_reward_scorer(config.RewardConfig()).score_one("gsm8k", "72", "72", None)[0] == 0.0


def test_pooled_and_spread_rows_show_a_bad_result_once(tmp_path):
    from hybridrl.rewards.distributed import RowItem, score_rows

    (tmp_path / "rw.py").write_text("def bad(a, b, c, d=None):\n    return 'oops'\n")
    scorer = RewardScorer(custom_fn=f"{tmp_path}/rw.py:bad")
    got = score_rows(scorer, [RowItem(3, "x", [1], "1", "src", {"index": 9})], 5.0)
    assert got == (f"reward function '{tmp_path}/rw.py:bad' returned str; allowed: a number or a "
                   "dict with a 'score' key on row 3 (data_source 'src', index 9)"), got
