"""Lesson 08's checkers: SmolLM2's bytes per token, and the bandwidth bound computed from a run's measurement."""

import pytest

from kvlessons import exercises
from kvlessons.memory import kv_bytes_per_token, preset


def test_smollm2_bytes_right_answer():
    """46,080 bytes per token in fp32, 23,040 in bf16: the package's formula on the model's preset."""
    shape = preset("SmolLM2-135M").shape
    assert exercises.SMOLLM2_FP32.answer == kv_bytes_per_token(shape, "fp32") == 2 * 30 * 3 * 64 * 4
    assert exercises.SMOLLM2_BF16.answer == kv_bytes_per_token(shape, "bf16") == 23040
    assert exercises.check_smollm2_bytes(46080, 23040).correct


@pytest.mark.parametrize(
    "fp32, bf16, diagnosis",
    [
        (2 * 30 * 9 * 64 * 4, 23040, "9 query heads"),  # query heads for KV heads (or hidden_size)
        (46080, 2 * 30 * 9 * 64 * 2, "9 query heads"),
        (46080, 11520, "count only keys"),  # K without V
        (23040, 23040, "either only keys were counted"),  # fp32 with K only, or with 2 bytes per value
        (1536, 23040, "one layer's share"),  # layers forgotten
        (46080, 46080, "fp32 figure"),
        (46080 * 8, 23040, "bits"),
        (45, 23040, "KiB"),
    ],
)
def test_smollm2_bytes_diagnoses(fp32, bf16, diagnosis):
    fb = exercises.check_smollm2_bytes(fp32, bf16)
    assert not fb.correct and diagnosis in fb.message, fb.message


def test_smollm2_bytes_odd_values_and_hints():
    fb = exercises.check_smollm2_bytes(None, ...)
    assert not fb.correct and fb.message.count("Expected a number") == 2
    hints = [exercises.hint("smollm2_bf16", level) for level in (1, 2, 3)]
    assert len(set(hints)) == 3 and "23,040" in hints[-1] and "23,040" not in hints[0]


# A run's measurements, as the notebook passes them (the numbers of one CPU run).
RUN = dict(bandwidth=28.6e9, weight_bytes=538_060_032, cache_bytes=2 * 30 * 3 * 64 * 4 * 49)
STEP = RUN["weight_bytes"] + RUN["cache_bytes"]
ANSWER = 1e3 * STEP / RUN["bandwidth"]


def test_decode_bound_right_answer_follows_the_measurement():
    """The answer is computed from the bandwidth passed in: another machine, another right answer."""
    assert exercises.check_decode_bound(ANSWER, **RUN).correct
    slower = dict(RUN, bandwidth=RUN["bandwidth"] / 3)
    assert exercises.check_decode_bound(3 * ANSWER, **slower).correct
    assert not exercises.check_decode_bound(ANSWER, **slower).correct


@pytest.mark.parametrize(
    "value, diagnosis",
    [
        (1e3 * RUN["weight_bytes"] / RUN["bandwidth"], "left out the cache"),  # 0.4% less: the tolerance must see it
        (1e3 * RUN["cache_bytes"] / RUN["bandwidth"], "counted only the cache"),
        (1e3 * (STEP + RUN["cache_bytes"]) / RUN["bandwidth"], "counted twice"),
        (STEP / RUN["bandwidth"], "seconds"),
        (8 * ANSWER, "bits"),
        (RUN["bandwidth"] / STEP, "inverse"),
        (ANSWER * 2**30 / 1e9, "GiB and GB"),
        (ANSWER * 1e6, "10^6 times"),
    ],
)
def test_decode_bound_diagnoses(value, diagnosis):
    fb = exercises.check_decode_bound(value, **RUN)
    assert not fb.correct and diagnosis in fb.message, fb.message


def test_decode_bound_unrecognised_gets_the_first_hint():
    fb = exercises.check_decode_bound(ANSWER * 1.3, **RUN)
    assert not fb.correct and exercises.DECODE_BOUND_HINTS[0] in fb.message


@pytest.mark.parametrize("bad", [None, "18.9", float("inf"), True, -5.0])
def test_decode_bound_odd_values_are_feedback(bad):
    fb = exercises.check_decode_bound(bad, **RUN)
    assert not fb.correct and fb.message


def test_decode_bound_bad_measurements_are_feedback():
    fb = exercises.check_decode_bound(ANSWER, bandwidth=None, weight_bytes=RUN["weight_bytes"], cache_bytes=0)
    assert not fb.correct and "bandwidth=bandwidth" in fb.message


def test_decode_bound_takes_a_rounded_answer_and_says_when_rounding_is_ambiguous():
    """19.4 for 19.44 ms is right (the notebook prints one decimal); 44 for 43.89 ms, nearer the
    'cache counted twice' slip, is not accepted: the learner hears that slip as a possibility, and that a rounded
    bandwidth typed from the printout is the other likely cause."""
    from kvlessons import exercises

    w, c, b = 538_060_032, 49 * 46_080, 27_795_506_970
    assert exercises.check_decode_bound(19.4, bandwidth=b, weight_bytes=w, cache_bytes=c).correct
    fb = exercises.check_decode_bound(44, bandwidth=12.3e9, weight_bytes=538_000_000, cache_bytes=46_080 * 40)
    assert not fb.correct and "If you did not make that slip" in fb.message and "`bandwidth`" in fb.message
    assert "counted twice" in fb.message  # the nearby slip, named as a possibility
    left_out = exercises.check_decode_bound(1e3 * w / b, bandwidth=b, weight_bytes=w, cache_bytes=c)
    assert not left_out.correct and "left out the cache" in left_out.message


def test_step_cost_right_answer_written_out():
    """Batch 16, context 256, fp32: 2 x 134,479,872 x 16 + 16 x 30 x 4 x 9 x 64 x 256 FLOPs; 4 x 134,479,872 + 46,080 x 256 x 16 bytes."""
    from kvlessons.exercises import check_step_cost

    assert check_step_cost(4_586_471_424, 726_663_168)
    assert check_step_cost(4.5865e9, 7.2666e8)  # rounded to 5 figures still passes


@pytest.mark.parametrize("flops, bytes_read, says", [
    (4_303_355_904, 726_663_168, "attention over the cache costs FLOPs"),
    (2 * 134_479_872 + 30 * 4 * 9 * 64 * 256, 726_663_168, "one sequence's work"),
    (4_586_471_424, 4 * 134_479_872 * 16 + 46_080 * 256 * 16, "read once per step"),
    (4_586_471_424, 4 * 134_479_872, "The cache is read at every step"),
    (4_586_471_424, 4 * 134_479_872 + 46_080 * 256, "times the batch"),
    (4_586_471_424, 726_663_168 // 2, "bf16"),
    (2 * 134_479_872 * 16 + 16 * 30 * 4 * 3 * 64 * 256, 726_663_168, "per *query* head"),
])
def test_step_cost_names_the_slip(flops, bytes_read, says):
    from kvlessons.exercises import check_step_cost

    feedback = check_step_cost(flops, bytes_read)
    assert not feedback and says in feedback.message


def test_step_cost_survives_odd_input():
    from kvlessons.exercises import check_step_cost

    for value in (None, "4e9", float("nan"), [1, 2]):
        assert not check_step_cost(value, value)


def test_step_cost_says_close_for_a_rounded_count_and_names_unit_slips():
    from kvlessons.exercises import check_step_cost

    fb = check_step_cost(4.6e9, 726_663_168)  # 0.3% off: rounded
    assert not fb and "Close" in fb.message
    fb = check_step_cost(4_586_471_424, 726_663_168 / 2**20)
    assert not fb and "MiB" in fb.message
    fb = check_step_cost("4586471424", 726_663_168)
    assert not fb and "remove the quotes" in fb.message
