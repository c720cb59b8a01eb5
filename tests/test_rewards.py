"""Reward functions: loading by module name or by file, the check before training, scoring in worker processes
(rewards and None, a row that raises, a function that hangs or kills its worker, rewards that are not finite
numbers), the failures' share over a run, and no worker left once the pool closes or its process is killed."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from helpers import REPO, wait_for

from finetune.errors import UserError
from finetune.tasks.rewards import (
    RewardFailure,
    RewardFailures,
    RewardPool,
    RewardScores,
    check_reward_signature,
    load_reward_funcs,
)

REWARDS = '''
import os
import time

THRESHOLD = 0.5


def length(prompts, completions, **columns):
    return [float(len(c if isinstance(c, str) else c[-1]["content"])) for c in completions]


def matches(prompts, completions, answer, **columns):
    return [None if a is None else float(c == a) for c, a in zip(completions, answer)]


def picky(prompts, completions, **columns):
    for completion in completions:
        if completion == "boom":
            raise ValueError(f"cannot score {completion!r}")
    return [1.0] * len(completions)


def lenient(prompts, completions, **columns):
    return [float(len(c)) for c in completions if c]


def hang(prompts, completions, **columns):
    if "hang" in completions:
        if "marker" in columns:
            open(columns["marker"][0], "w").close()
        time.sleep(60)
    return [0.5] * len(completions)


def die(prompts, completions, **columns):
    if "exit" in completions:
        os._exit(1)
    if "kill" in completions:
        os.kill(os.getpid(), 9)
    return [2.0] * len(completions)


def odd(prompts, completions, **columns):
    return [{"nan": float("nan"), "inf": float("inf"), "text": "abc"}.get(c, 1.0) for c in completions]


def chatty(prompts, completions, **columns):
    print("scoring", len(completions), "completions")
    return [float(len(c)) for c in completions]


def positional(text):
    return [1.0]


def two(prompts, completions, **columns):
    return [1.0, 2.0]


def sees(prompts, completions, **columns):
    return [float(name in os.environ) for name in completions]
'''


@pytest.fixture
def rewards(tmp_path) -> Path:
    """The reward functions above, in ``tmp_path/my_rewards.py``."""
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def specs(path: Path, *names: str) -> list[str]:
    return [f"{path}:{name}" for name in names]


def worker_processes() -> list[psutil.Process]:
    def is_worker(process: psutil.Process) -> bool:
        try:
            return "finetune.tasks.workers" in process.cmdline()
        except psutil.NoSuchProcess:  # another test's child, gone since it was listed (a zombie too)
            return False
    return [p for p in psutil.Process().children(recursive=True) if is_worker(p)]


def test_functions_load_by_module_name_and_by_file(rewards, tmp_path, monkeypatch, request):
    (tmp_path / "reward_pkg_for_tests").mkdir()
    (tmp_path / "reward_pkg_for_tests" / "__init__.py").write_text("")
    (tmp_path / "reward_pkg_for_tests" / "checks.py").write_text(REWARDS)
    request.addfinalizer(lambda: [sys.modules.pop(name, None)
                                  for name in ("reward_pkg_for_tests", "reward_pkg_for_tests.checks")])
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.chdir(tmp_path)
    names = ["reward_pkg_for_tests.checks:length", "my_rewards.py:length", f"{rewards}:matches"]
    funcs = load_reward_funcs(names)
    assert [f.name for f in funcs] == names
    assert funcs[0].func(prompts=["p"], completions=["abcd"]) == [4.0]
    assert funcs[1].func(prompts=["p"], completions=["ab"]) == [2.0]
    assert funcs[2].func(prompts=["p"], completions=["x", "y"], answer=["x", None]) == [1.0, None]
    # The workers import the module by name from this process's sys.path, and the file relative to this directory.
    with RewardPool(names[:2]) as pool:
        scores = pool.score(["p", "q"], ["abc", "hello"], {"answer": ["abc", "x"]})
    np.testing.assert_array_equal(scores.values, [[3.0, 3.0], [5.0, 5.0]])


@pytest.mark.parametrize(("spec", "message"), [
    ("my_rewards", r"reward function 'my_rewards' is not module:function; give a dotted module or a path to a \.py"),
    ("no_such_rewards_module:score", r"cannot import no_such_rewards_module: ModuleNotFoundError: No module named "
                                     r"'no_such_rewards_module'; give a module importable from here"),
    ("{dir}/missing.py:score", r"missing\.py is no such file; give the path to a \.py file"),
    ("{dir}/broken.py:score", r"cannot import .*broken\.py: RuntimeError: needs a GPU; fix what it raised"),
    ("{dir}/typo.py:score", r"cannot import .*typo\.py: SyntaxError: .*\(typo\.py, line 1\)"),
    ("{file}:nothing", r"my_rewards\.py has no 'nothing' \(it defines chatty, die, .*length.*\); give the name of a "
                       r"function"),
    ("{file}:THRESHOLD", r"THRESHOLD is a float, not a function; give a function func\(prompts, completions"),
])
def test_a_bad_spec_names_the_problem(rewards, tmp_path, spec, message):
    (tmp_path / "broken.py").write_text("raise RuntimeError('needs a GPU')\n")
    (tmp_path / "typo.py").write_text("def score(:\n")
    with pytest.raises(UserError, match=message):
        load_reward_funcs([spec.format(dir=tmp_path, file=rewards)])


IMPORT_SIDE_EFFECT = """
import os
import pathlib
import time

pathlib.Path({marker!r}).write_text(os.environ.get("HF_TOKEN", "no token"))
time.sleep({sleep})


def score(prompts, completions, **columns):
    return [1.0] * len(completions)
"""


def test_the_trainer_checks_specs_without_importing_them_and_only_the_workers_run_the_modules(tmp_path, monkeypatch):
    """A module's top level runs where the function does, in a worker without the trainer's tokens; the trainer's
    own check (before anything heavy loads) finds the file or module and runs none of its code."""
    from helpers import load_recipe

    from finetune.config import parse_config

    marker, module = tmp_path / "imported", tmp_path / "loud_rewards.py"
    module.write_text(IMPORT_SIDE_EFFECT.format(marker=str(marker), sleep=0))
    monkeypatch.setenv("HF_TOKEN", "hf_write_token")
    parse_config(load_recipe("grpo").GRPOArguments, ["--reward_funcs", f"{module}:score"])
    assert not marker.exists()
    with RewardPool([f"{module}:score"]) as pool:
        assert pool.score(["p"], ["c"], {}).values.tolist() == [[1.0]]
    assert marker.read_text() == "no token"


def test_a_module_whose_import_hangs_is_refused_when_the_workers_take_longer_than_the_start_up_allows(
        tmp_path, monkeypatch):
    from finetune.tasks import workers

    monkeypatch.setattr(workers, "STARTUP_TIMEOUT", 3.0)
    module = tmp_path / "slow_import.py"
    module.write_text(IMPORT_SIDE_EFFECT.format(marker=str(tmp_path / "imported"), sleep=3600))
    with pytest.raises(UserError, match=r"a reward worker process did not load .*slow_import\.py:score within 3 s"):
        with RewardPool([f"{module}:score"]) as pool:
            pool.score(["p"], ["c"], {})
    assert not worker_processes()


def test_a_spec_given_twice_is_refused(rewards):
    with pytest.raises(UserError, match=r"reward function .*my_rewards\.py:length is given twice"):
        load_reward_funcs(specs(rewards, "length", "length"))


def test_the_signature_check_calls_each_function_on_an_example_row_in_the_pool(rewards):
    with RewardPool(specs(rewards, "length", "matches"), timeout=30) as pool:
        check_reward_signature(pool, "What is 2 + 2?", "4", {"answer": "4"})
        with pytest.raises(UserError, match=r"reward function .*:matches raised TypeError: matches\(\) missing 1 "
                                            r"required positional argument: 'answer' on an example row; expected "
                                            r"TRL's signature func\(prompts, completions, \*\*columns\) -> list of "
                                            r"floats or None, called as func\(prompts=\[...\], completions=\[...\]\)"):
            check_reward_signature(pool, "What is 2 + 2?", "4")
    with RewardPool(specs(rewards, "positional", "two", "odd")) as pool:
        with pytest.raises(UserError, match=r"reward function .*:positional raised TypeError: positional\(\) got an "
                                            r"unexpected keyword argument 'prompts'.*expected TRL's signature"):
            check_reward_signature(pool, "p", "c")
    with RewardPool(specs(rewards, "two")) as pool, pytest.raises(
            UserError, match=r"reward function .*:two returned 2 rewards for 1 completion on an example row; "
                             r"expected TRL's signature"):
        check_reward_signature(pool, "p", "c")
    with RewardPool(specs(rewards, "odd")) as pool, pytest.raises(
            UserError, match=r"reward function .*:odd returned 'abc' \(str\), not a number or None"):
        check_reward_signature(pool, "p", "text")


def test_a_function_that_hangs_on_the_example_row_is_refused_within_the_timeout(rewards):
    start = time.monotonic()
    with RewardPool(specs(rewards, "length", "hang"), timeout=2) as pool, pytest.raises(
            UserError, match=r"reward function .*:hang timed out after 2 s; its worker process was killed and "
                             r"replaced on an example row; make it score one row within --reward_timeout"):
        check_reward_signature(pool, "p", "hang")
    assert time.monotonic() - start < 15  # the sleep is 60 s
    assert worker_processes() == []


def test_a_worker_gets_no_token_of_the_trainer_s_environment_unless_it_is_passed(rewards, monkeypatch):
    """A reward may run model-written code: HF_TOKEN (write access to the user's models) and trackers' keys stay
    in the trainer; a judge's key is passed by name (--reward_env)."""
    for name in ("HF_TOKEN", "WANDB_API_KEY", "JUDGE_API_KEY"):
        monkeypatch.setenv(name, "secret")
    names = ["HF_TOKEN", "WANDB_API_KEY", "JUDGE_API_KEY", "PATH", "HOME"]
    with RewardPool(specs(rewards, "sees")) as pool:
        np.testing.assert_array_equal(pool.score([""] * 5, names).values.flatten(), [0, 0, 0, 1, 1])
    with RewardPool(specs(rewards, "sees"), passed_environment=["JUDGE_API_KEY"]) as pool:
        np.testing.assert_array_equal(pool.score([""] * 5, names).values.flatten(), [0, 0, 1, 1, 1])


def test_the_pool_scores_each_function_with_none_as_nan(rewards):
    with RewardPool(specs(rewards, "length", "matches"), timeout=30) as pool:
        scores = pool.score(["p"] * 3, ["abc", "x", "hello"], {"answer": ["abc", None, "nope"]})
        # Prompts and completions reach the functions as given: here as messages.
        chat = pool.score([[{"role": "user", "content": "hi"}]], [[{"role": "assistant", "content": "hey"}]],
                          {"answer": [None]})
    assert scores.values.dtype == np.float64
    np.testing.assert_array_equal(scores.values, [[3.0, 1.0], [1.0, np.nan], [5.0, 0.0]])
    assert scores.failures == []
    np.testing.assert_array_equal(chat.values, [[3.0, np.nan]])
    assert chat.failures == []


def test_what_a_function_prints_and_a_batch_larger_than_a_pipe_leave_the_rewards_as_they_are(rewards, capfd):
    completions = [f"{i:05d}" * 20 for i in range(2000)]  # 200 kB each way, a pipe holds 64 kB
    with RewardPool(specs(rewards, "chatty")) as pool:
        scores = pool.score([""] * len(completions), completions)
    np.testing.assert_array_equal(scores.values, np.full((2000, 1), 100.0))
    assert scores.failures == []
    assert "scoring 2000 completions" in capfd.readouterr().err


def test_a_function_that_fails_on_some_rows_fails_those_rows_only(rewards):
    line = REWARDS.splitlines().index('            raise ValueError(f"cannot score {completion!r}")') + 1
    with RewardPool(specs(rewards, "picky", "lenient"), workers=1) as pool:
        scores = pool.score(["p"] * 4, ["a", "boom", "", "cc"])
    # picky raises on the batch and on row 1 alone; lenient drops the empty completion, so its batch is one short.
    np.testing.assert_array_equal(scores.values, [[1.0, 1.0], [np.nan, 4.0], [1.0, np.nan], [1.0, 2.0]])
    assert scores.failures == [
        RewardFailure(f"{rewards}:picky", 1, f"raised ValueError: cannot score 'boom' (my_rewards.py, line {line})"),
        RewardFailure(f"{rewards}:lenient", 2, "returned 0 rewards for 1 completion"),
    ]


def test_a_hanging_function_times_out_and_the_pool_goes_on(rewards):
    names = specs(rewards, "length", "hang")
    start = time.monotonic()
    with RewardPool(names, workers=2, timeout=1) as pool:
        hung = pool.score(["p", "q"], ["hang", "x"])
        after_timeout = time.monotonic() - start
        scores = pool.score(["p"], ["fine"])
    assert after_timeout < 10
    np.testing.assert_array_equal(hung.values, [[4.0, np.nan], [1.0, np.nan]])
    reason = "timed out after 1 s; its worker process was killed and replaced"
    assert hung.failures == [RewardFailure(names[1], 0, reason), RewardFailure(names[1], 1, reason)]
    np.testing.assert_array_equal(scores.values, [[4.0, 0.5]])
    assert scores.failures == []
    assert time.monotonic() - start < 10
    assert worker_processes() == []


def test_a_function_that_ends_its_worker_fails_the_batch_with_its_exit_status(rewards):
    (name,) = specs(rewards, "die")
    with RewardPool([name]) as pool:
        exited = pool.score(["p", "q"], ["exit", "x"])
        killed = pool.score(["p"], ["kill"])
        scores = pool.score(["p", "q"], ["a", "b"])
    assert np.isnan(exited.values).all() and np.isnan(killed.values).all()
    died = "the worker process running it died"
    assert exited.failures == [RewardFailure(name, 0, f"{died} (exit status 1)"),
                               RewardFailure(name, 1, f"{died} (exit status 1)")]
    assert killed.failures == [RewardFailure(name, 0, f"{died} (killed by SIGKILL)")]
    np.testing.assert_array_equal(scores.values, [[2.0], [2.0]])
    assert scores.failures == []


def test_rewards_that_are_not_finite_numbers_fail_their_rows(rewards):
    (name,) = specs(rewards, "odd")
    with RewardPool([name]) as pool:
        scores = pool.score(["p"] * 4, ["nan", "ok", "inf", "text"])
    np.testing.assert_array_equal(scores.values, [[np.nan], [1.0], [np.nan], [np.nan]])
    finite = "not a finite number (return None for a row the function does not apply to)"
    assert scores.failures == [RewardFailure(name, 0, f"returned nan, {finite}"),
                               RewardFailure(name, 2, f"returned inf, {finite}"),
                               RewardFailure(name, 3, "returned 'abc' (str), not a number or None")]


def test_failures_over_a_run_stop_it_past_the_share(rewards):
    failures = RewardFailures(["acc", "fmt"])
    ones = np.ones((4, 2))
    failures.add(RewardScores(ones, [RewardFailure("acc", 2, "raised ValueError: no answer")]), rows=[10, 11, 12, 13])
    failures.check(0.25)
    assert failures.figures() == {"reward_failures/acc": 1, "reward_failures/acc/share": 0.25,
                                  "reward_failures/fmt": 0, "reward_failures/fmt/share": 0.0}
    with pytest.raises(UserError, match=r"^reward function acc failed on 1 of 4 rows \(25\.0%\), more than "
                                        r"--max_reward_failures 0\.2 allows; first on row 12: raised ValueError: no "
                                        r"answer; fix the function, or raise --max_reward_failures, the share"):
        failures.check(0.2)
    # Rows are numbered by position from here on; the first failure stays the one named.
    failures.add(RewardScores(ones, [RewardFailure("acc", 1, "returned nan")]))
    failures.check(0.25)
    assert failures.counts["acc"].failed == 2 and failures.counts["acc"].scored == 8
    assert failures.counts["acc"].first_row == 12
    failures.add(RewardScores(ones, [RewardFailure("fmt", 3, "returned 'x' (str), not a number or None")]))
    assert failures.counts["fmt"].first_row == 11
    assert failures.figures()["reward_failures/fmt/share"] == pytest.approx(1 / 12)
    with pytest.raises(UserError, match=r"from 0 to 1"):
        failures.check(1.5)


def test_no_worker_is_left_after_the_pool_closes(rewards):
    with RewardPool(specs(rewards, "length", "die")) as pool:
        pool.score(["p"], ["exit"])  # one worker replaced
        # (a worker just started shows the parent's command line until it has exec'd)
        started = wait_for(lambda: [workers for workers in [worker_processes()] if len(workers) == 2], "two workers",
                           timeout=30)[0]
    assert worker_processes() == []
    assert not any(process.is_running() for process in started)


def test_workers_die_with_a_killed_training_process(rewards, tmp_path):
    """A training process killed (SIGKILL, the OOM killer) while a worker runs a function that hangs."""
    marker = tmp_path / "hanging"
    script = tmp_path / "train.py"
    script.write_text("import sys\n"
                      "from finetune.tasks.rewards import RewardPool\n"
                      "pool = RewardPool([sys.argv[1]], timeout=60)\n"
                      "pool.score(['p'], ['hang'], {'marker': [sys.argv[2]]})\n")
    job = subprocess.Popen([sys.executable, str(script), f"{rewards}:hang", str(marker)], cwd=REPO)
    try:
        wait_for(marker.exists, "the reward function to hang", job=job, timeout=60)
        (worker,) = psutil.Process(job.pid).children()
        job.send_signal(signal.SIGKILL)
        assert job.wait(10) == -signal.SIGKILL
        wait_for(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, "the worker to end",
                 timeout=10)
    finally:
        job.kill()
        job.wait()
