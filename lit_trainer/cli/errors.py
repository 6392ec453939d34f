"""Command-line errors that read well: our message first, close-name suggestions, negative numbers as values.

jsonargparse reports a bad ``--model``/``--data`` option inside a "Does not validate against any of the Union
subtypes ... Given value: Namespace(...)" block, where the useful line (our validation message, or "Option 'x' is
not accepted") sits in the middle. :func:`lead_message` pulls it out; :func:`suggest` adds "did you mean".
"""

from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from lightning.pytorch.cli import LightningArgumentParser

_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
_UNION = "Does not validate against any of the Union subtypes"
_CLASS_PROBLEM = re.compile(r"Problem with given class_path '([\w.]+)':")
_NOT_ACCEPTED = re.compile(r"(?:Option|Key) '([\w.]+)' is not accepted")
_LITERAL = re.compile(r"Expected a typing\.Literal\[(.*?)\]\. Got value: (\S+)")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (--[\w.]+)", re.IGNORECASE)
_PACKAGE = Path(__file__).resolve().parents[1]  # the lit_trainer package
# What lit_trainer's own checks raise (a bad value, a missing or empty file, a refused checkpoint).
_CHECK_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
TRACEBACK_ENV = "LIT_TRAINER_TRACEBACK"


def join_negative_numbers(args: Sequence[str]) -> list[str]:
    """``["--x", "-1e-3"]`` -> ``["--x=-1e-3"]``: argparse takes ``-1e-3`` for an option, so ``--x -1e-3`` fails.

    Example:
        >>> join_negative_numbers(["fit", "--model.init_args.learning_rate", "-1e-3", "--trainer.max_steps", "5"])
        ['fit', '--model.init_args.learning_rate=-1e-3', '--trainer.max_steps', '5']
    """
    out: list[str] = []
    for arg in args:
        if out and _NEGATIVE_NUMBER.match(arg) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def lead_message(message: str) -> str:
    """The informative part of a jsonargparse "Union subtypes" message (unchanged when it is not one).

    Keeps the errors of the class that was given (dropping "Expected a <class 'NoneType'>" and the ``Given value``
    dump) and names the class; any other message is returned as is.

    Example:
        >>> text = ("Parser key \\"model\\":\\n  Does not validate against any of the Union subtypes\\n"
        ...         "  Subtypes: [A]\\n  Errors:\\n    - Problem with given class_path 'pkg.A':\\n"
        ...         "        Option 'lr' is not accepted\\n"
        ...         "    - Expected a <class 'NoneType'>\\n  Given value type: x\\n  Given value: y")
        >>> lead_message(text)
        "model (pkg.A): Option 'lr' is not accepted"
    """
    if _UNION not in message:
        return message
    key = re.search(r'Parser key "([\w.]+)"', message)
    lines = message.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Errors:"), None)
    if start is None:
        return message
    items: list[list[str]] = []
    for line in lines[start + 1 :]:
        if line.lstrip().startswith("Given value"):
            break
        if line.lstrip().startswith("- "):
            items.append([line.lstrip()[2:]])
        elif items:
            items[-1].append(line.strip())
    kept = [item for item in items if not item[0].startswith("Expected a <class 'NoneType'>")] or items
    texts = []
    for item in kept:
        head = _CLASS_PROBLEM.match(item[0])
        body = " ".join(part for part in item[1:] if part) if head else " ".join(item)
        where = f"{key.group(1)} ({head.group(1)})" if key and head else key.group(1) if key else ""
        texts.append(f"{where}: {body}" if where else body)
    return "\n".join(texts)


def init_parameters(class_path: str) -> list[str]:
    """Argument names of a class's ``__init__`` and of its bases' (empty when it cannot be imported)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return []
    names: list[str] = []
    for klass in inspect.getmro(cls):
        if "__init__" in vars(klass):
            names += [
                p for p in inspect.signature(vars(klass)["__init__"]).parameters if p not in ("self", "args", "kwargs")
            ]
    return list(dict.fromkeys(names))


def _did_you_mean(bad: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(bad, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def suggest(message: str, options: Iterable[str] = ()) -> str:
    """Append "Did you mean ...?" for a misspelled class argument, ``Literal`` value or command-line option.

    Example:
        >>> suggest("Expected a typing.Literal['cosine', 'linear']. Got value: cosin")
        "Expected a typing.Literal['cosine', 'linear']. Got value: cosin (did you mean 'cosine'?)"
    """
    if "(did you mean" in message or "'=' form" in message:  # already annotated (errors are re-raised upwards)
        return message
    hint = ""
    if (bad := _NOT_ACCEPTED.search(message)) and (
        owner := _CLASS_PROBLEM.search(message) or re.search(r"\(([\w.]+)\)", message)
    ):
        hint = _did_you_mean(bad.group(1), init_parameters(owner.group(1)))
    elif literal := _LITERAL.search(message):
        try:
            values = [str(v) for v in ast.literal_eval(f"[{literal.group(1)}]")]
        except (ValueError, SyntaxError):
            values = []
        hint = _did_you_mean(literal.group(2), values)
    elif bad := _UNRECOGNIZED.search(message):
        hint = _did_you_mean(bad.group(1), options)
    if "expected one argument" in message:
        hint += " (a negative number needs the '=' form: --model.init_args.learning_rate=-1e-3)"
    return message + hint


class FriendlyParser(LightningArgumentParser):
    """``LightningArgumentParser`` whose errors lead with the actionable line (no 60-line usage dump before it)."""

    def _option_names(self) -> list[str]:
        return [opt for action in self._actions for opt in action.option_strings]

    _given_args: tuple[str, ...] = ()  # the command line being parsed, to name a broken config file

    def parse_args(self, args: Any = None, *rest: Any, **kwargs: Any) -> Any:
        """jsonargparse's ``parse_args``; the arguments are kept to locate a config file's YAML error."""
        if args is None or isinstance(args, (list, tuple)):
            FriendlyParser._given_args = tuple(str(a) for a in (sys.argv[1:] if args is None else args))
        return super().parse_args(args, *rest, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        """Shorten and annotate the message, then report it as jsonargparse does."""
        parser = getattr(ex, "subcommand_parser", None) or self
        names = parser._option_names() if isinstance(parser, FriendlyParser) else self._option_names()
        message = locate_config_problem(message, FriendlyParser._given_args)
        super().error(suggest(lead_message(message), names), ex)

    def print_usage(self, file: Any = None) -> None:
        """One line instead of every option (``--help`` lists them)."""
        (file or sys.stdout).write(f"usage: {self.prog} [--config FILE] [--section.option VALUE ...]\n")


def raised_by_our_checks(error: BaseException) -> bool:
    """Whether ``error`` is one of lit_trainer's own input checks: a ``ValueError`` whose innermost frame is in the
    ``lit_trainer`` package, or a missing-file error met while lit_trainer reads its inputs. Those messages already
    say what is wrong, so the console script prints them without the traceback; anything else (a bug, an error
    raised inside torch or Lightning) keeps its traceback."""
    if not isinstance(error, _CHECK_ERRORS):
        return False
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE))
        tb = tb.tb_next
    if isinstance(error, OSError):  # raised by open()/stat() in the standard library, on lit_trainer's behalf
        return any(frames)
    return bool(frames) and frames[-1]


def exit_with_message(error: BaseException) -> NoReturn:
    """Print ``error`` as one ``lit-trainer: error: ...`` paragraph on stderr and exit with status 1."""
    sys.stderr.write(f"lit-trainer: error: {error}\n(set {TRACEBACK_ENV}=1 to see the traceback)\n")
    raise SystemExit(1)


def friendly_value_error(error: ValueError) -> ValueError | None:
    """A shorter ``ValueError`` for a jsonargparse "Union subtypes" error raised while building the classes."""
    message = str(error)
    if _UNION not in message:
        return None
    return ValueError(suggest(lead_message(message)))


def config_paths(args: Sequence[str]) -> list[Path]:
    """The existing files given to ``--config`` in a command line (``--config F`` or ``--config=F``).

    Example:
        >>> config_paths(["fit", "--config", "/nonexistent.yaml", "--config=/"])
        []
    """
    given = [arg.split("=", 1)[1] for arg in args if arg.startswith("--config=")]
    given += [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--config"]
    return [Path(p) for p in given if Path(p).is_file()]


def yaml_problem(path: Path) -> str | None:
    """What is wrong with a YAML file, located in it: ``"<path>", line L, column C: <problem>``; a tab used for
    indentation is named as such. ``None`` when the file parses."""
    import yaml

    text = path.read_text(errors="replace")
    try:
        yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
        problem = getattr(error, "problem", None) or str(error)
        if mark is None:
            return f'"{path}": {problem}'
        lines = text.splitlines()
        line = lines[mark.line] if mark.line < len(lines) else ""
        where = f'"{path}", line {mark.line + 1}, column {mark.column + 1}'
        if "\t" in line[: max(mark.column, 0) + 1] or (problem and "\t" in line and "token" in problem):
            return f"{where}: a tab character; YAML indents with spaces only, so replace the tab with spaces."
        text_there = f": {line.strip()!r}" if line.strip() else ""
        context, start = getattr(error, "context", None), getattr(error, "context_mark", None)
        if context and start is not None and start.line != mark.line:
            context_line = lines[start.line].strip() if start.line < len(lines) else ""
            text_there += f" ({context.removeprefix('while ')} that starts at line {start.line + 1}: {context_line!r})"
        return f"{where}: {problem}{text_there}"
    return None


def locate_config_problem(message: str, args: Sequence[str]) -> str:
    """jsonargparse reports a broken ``--config`` file as ``in "<unicode string>"``; name the file and the line
    instead, and say "tab" when a tab is the problem (the message is unchanged when no given file fails to parse)."""
    if "<unicode string>" not in message:
        return message
    for path in config_paths(args):
        problem = yaml_problem(path)
        if problem is not None:
            return f"The config file {problem}"
    return message
