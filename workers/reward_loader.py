"""Your own reward: a function named in the config, loaded from an importable module or from a Python file.

    reward = load_reward(function="mypkg.rewards:exact")                 # reward: {function: "mypkg.rewards:exact"}
    reward = load_reward(function="exact", file="/home/me/rewards.py")   # reward: {file: rewards.py, function: exact}
    reward = load_reward(name="gsm8k")                                   # reward: {name: gsm8k}, a built-in
    result = workers.rewards.score(reward, completions, answers, prompts=questions, task="t")

Design decisions:
- The contract is the built-ins': `fn(completion: str, answer: str) -> float`, called once per sample with the
  decoded completion (special tokens stripped) and the record's answer field as a string. A function that
  declares a parameter named `prompt` also gets the question text (before any chat template). With
  `batch=True` it is called once per step: `fn(completions: list[str], answers: list[str]) -> list[float]`
  (`prompts` likewise), samples in order, the G completions of each prompt next to each other.
- Checked on load, before anything runs: the module or file imports, the name is a callable, and
  `inspect.signature(fn).bind(...)` accepts exactly the call `score` will make. Loading is the check: the CLI
  (`rlsched train`, `rlsched submit`) loads it once to refuse a bad config with exit 2, and the task's driver
  loads it again where it scores, so what runs is what was checked, in whatever process that is.
- A file is loaded by its path (`importlib.util.spec_from_file_location`) in the process that calls it, never
  through sys.path: a Ray worker or the scheduler service, started in another directory, finds it all the same.
  The config makes the path absolute when it is read (relative to the config file's directory). The module
  is registered in sys.modules under a name made from the path, so its dataclasses and pickles work.
- A module (`pkg.module:fn`) is imported by name, so it must be importable where the task runs: installed,
  or on PYTHONPATH there (for the service, in the environment of `rlsched up`). A file needs neither.
- Every error is one line naming the file and line: a SyntaxError says where the parser stopped, an error
  raised while importing says the innermost line of the file that raised it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
import traceback
from pathlib import Path

from workers.rewards import REWARDS, Reward, builtin

SIGNATURE = ("a reward is fn(completion: str, answer: str) -> float, called once per sample (add a `prompt` "
             "parameter to get the question too); with reward.batch: true, fn(completions: list[str], "
             "answers: list[str]) -> list[float], called once per step")


class RewardLoadError(ValueError):
    """A reward that cannot be loaded or called as a reward; one line naming the file (and line) and why."""


def load_reward(*, name: str | None = None, function: str | None = None, file: str | Path | None = None,
                batch: bool = False) -> Reward:
    """The reward a config's `reward:` section names, loaded and checked (RewardLoadError otherwise)."""
    if name is not None:
        if name not in REWARDS:
            raise RewardLoadError(f"unknown reward {name!r}; known rewards: {', '.join(sorted(REWARDS))} "
                                  "(or your own: reward.function)")
        return builtin(name)
    if function is None:
        raise RewardLoadError("the reward names no function: set reward.name (a built-in) or reward.function")
    if file is not None:
        fn, origin = _from_file(Path(file), function), f"reward file {file}"
    else:
        fn, origin = _from_module(function)
    return _as_reward(fn, function, origin, batch)


def _from_file(path: Path, function: str):
    if not path.is_file():
        what = "is a directory, not a Python file" if path.is_dir() else "does not exist"
        raise RewardLoadError(f"reward file {path} {what}")
    # One module name per path: a second load replaces the first (the file may have changed), another file's
    # module is never touched.
    module_name = "rlsched_user_reward_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RewardLoadError(f"reward file {path} cannot be loaded as Python (name it *.py)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - anything the file raises on import is the user's to see, with its line
        del sys.modules[module_name]
        raise RewardLoadError(f"reward file {path} {_line(err, str(path))}: {_describe(err)}") from None
    if not hasattr(module, function):
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                         and getattr(v, "__module__", None) == module_name)
        raise RewardLoadError(f"reward file {path} has no function {function!r}; it defines: "
                              f"{', '.join(defined) or 'no functions'}")
    return getattr(module, function)


def _from_module(function: str):
    module_name, _, attr = function.partition(":")
    if not module_name or not attr:
        raise RewardLoadError(f"reward function {function!r} must read 'module:function' (e.g. 'mypkg.rewards:exact'),"
                              " or name its file with reward.file")
    origin = f"reward module {module_name!r}"
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - as above
        at = _line(err, None)
        hint = ("; install it or put its directory on PYTHONPATH where the task runs (for the service: where "
                "`rlsched up` ran), or name a file with reward.file" if isinstance(err, ModuleNotFoundError)
                and err.name and module_name.startswith(err.name) else "")
        raise RewardLoadError(f"{origin} cannot be imported{(' (' + at + ')') if at else ''}: "
                              f"{_describe(err)}{hint}") from None
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise RewardLoadError(f"{origin} ({getattr(module, '__file__', '?')}) has no attribute {attr!r}")
        fn = getattr(fn, part)
    return fn, f"{origin} ({getattr(module, '__file__', '?')})"


def _as_reward(fn, function: str, origin: str, batch: bool) -> Reward:
    if not callable(fn):
        raise RewardLoadError(f"{origin}: {function!r} is a {type(fn).__name__}, not a function")
    if inspect.iscoroutinefunction(fn):
        raise RewardLoadError(f"{origin}: {function!r} is an async function; a reward must be a plain function")
    code = getattr(inspect.unwrap(fn), "__code__", None)
    file = code.co_filename if code is not None else None
    where = f"{file} line {code.co_firstlineno}" if code is not None else origin
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some C callables have none: nothing to check before calling
        return Reward(fn=fn, label=_label(function, file), batch=batch, file=file)
    extra = "prompts" if batch else "prompt"
    passes = extra in signature.parameters
    call = ("completions, answers" if batch else "completion, answer") + (f", {extra}=" if passes else "")
    try:
        signature.bind("x", "x", **({extra: "x"} if passes else {}))
    except TypeError as err:
        short = function.rpartition(":")[2]
        raise RewardLoadError(f"reward function {short}{signature} ({where}) cannot be called as {short}({call}): "
                              f"{err}; {SIGNATURE}") from None
    return Reward(fn=fn, label=_label(function, file), batch=batch, passes_prompt=passes, file=file)


def _label(function: str, file: str | None) -> str:
    return repr(function) + (f" ({file})" if file and ":" not in function else "")


def _line(err: BaseException, file: str | None) -> str:
    """'line N' (in `file`) where `err` was raised; for a SyntaxError, where the parser stopped."""
    if isinstance(err, SyntaxError) and err.lineno is not None:
        path, line = err.filename, err.lineno
    else:
        # The importing machinery's frames (frozen importlib, this module) say nothing of the user's code.
        frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith("<frozen")
                  and f.filename not in (__file__, importlib.__file__)]
        own = [f for f in frames if f.filename == file]
        if not (own or frames):
            return ""
        path, line = (own or frames)[-1].filename, (own or frames)[-1].lineno
    return f"line {line}" if path == file else f"{path} line {line}"


def _describe(err: BaseException) -> str:
    msg = err.msg if isinstance(err, SyntaxError) else str(err)
    return f"{type(err).__name__}: {msg}"
