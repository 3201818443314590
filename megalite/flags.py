"""Command-line flags as rows of a table mapped onto config dataclasses, and the parser every command uses.

A :class:`Flag` row whose ``fields`` name config fields (``"GPTConfig.hidden_size"``) takes its default
from that dataclass and its value goes into that field, so a command line and the Python API share
defaults and validation; a row without fields is a script option whose default is in the row.  A
:class:`FlagTable` holds rows and the dataclasses their fields name.  Each layer keeps its rows where
its configs live (``SHARED_FLAGS`` here, pretraining's in ``megalite.training.flags``, RL's in
``megalite.rlhf.flags``) and a command adds the tables it needs to one :class:`ArgumentParser`, which
raises ValueError for bad input so that ``megalite.cli.run_cli`` prints one line.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import MISSING, dataclass

UNSET = object()
"""Marks a Flag's ``default``/``sets`` as not given (``None`` is a real default)."""


@dataclass(frozen=True)
class Flag:
    """One flag.

    ``fields``: the config fields it sets (``"Class.field"``); the first one's dataclass default is
    the flag's default unless ``default`` is given (only for a field the command derives, documented
    by a help text starting "None:", or one without a dataclass default).  ``sets``: for a switch,
    the value the fields take when it is given (else they keep their defaults).  The remaining
    keywords go to ``argparse.add_argument``.
    """

    name: str
    group: str
    fields: tuple[str, ...] = ()
    default: object = UNSET
    sets: object = UNSET
    type: object = None
    choices: tuple | None = None
    nargs: object = None
    required: bool = False
    help: str = ""

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


class FlagTable:
    """Flag rows and the config dataclasses (by class name) that their ``fields`` refer to."""

    def __init__(self, flags, configs=()):
        self.flags = tuple(flags)
        self.configs = {cls.__name__: cls for cls in configs}
        names = [f.name for f in self.flags]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"flags defined twice: {', '.join(repeated)}")
        for flag in self.flags:
            for target in flag.fields:
                cls_name, field = target.split(".")
                if field not in {f.name for f in dataclasses.fields(self.configs[cls_name])}:
                    raise ValueError(f"flag {flag.name}: {cls_name} has no field {field}")

    def __add__(self, other: FlagTable) -> FlagTable:
        return FlagTable(self.flags + other.flags, (*self.configs.values(), *other.configs.values()))

    def __iter__(self):
        return iter(self.flags)

    def field_default(self, target: str):
        """The dataclass default of ``"Class.field"`` (``MISSING`` when it has none)."""
        cls_name, field = target.split(".")
        spec = {f.name: f for f in dataclasses.fields(self.configs[cls_name])}[field]
        return spec.default_factory() if spec.default_factory is not MISSING else spec.default

    def default(self, flag: Flag):
        """The value ``flag`` has when it is not given."""
        if flag.default is not UNSET or not flag.fields:
            return None if flag.default is UNSET else flag.default
        if flag.sets is not UNSET:
            return False
        value = self.field_default(flag.fields[0])
        if value is MISSING:
            raise ValueError(f"flag {flag.name}: {flag.fields[0]} has no default, so the table must give one")
        return value

    def add_to(self, parser: argparse.ArgumentParser, names=None, defaults=None, helps=None, required=()) -> None:
        """Add the rows (those in ``names``, in table order, when given) to ``parser``, one argument group
        per row group.  ``defaults``/``helps`` (by flag name) give a command its own default or help text:
        such a flag's default is the command's, not a config's; flags in ``required`` must be given."""
        defaults, helps = defaults or {}, helps or {}
        unknown = sorted((set(names or ()) | set(defaults) | set(helps) | set(required))
                         - {f.name for f in self.flags})
        if unknown:
            raise KeyError(f"not in this flag table: {', '.join(unknown)}")
        groups = {g.title: g for g in parser._action_groups}
        for flag in self.flags:
            if names is not None and flag.name not in names:
                continue
            if flag.name in defaults:
                derived = flag.help.startswith("None:")  # the table's derivation is not the command's
                flag = dataclasses.replace(flag, default=defaults[flag.name], fields=(),
                                           help="" if derived else flag.help)
            if flag.name in helps:
                flag = dataclasses.replace(flag, help=helps[flag.name])
            if flag.name in required:
                flag = dataclasses.replace(flag, required=True)
            if flag.group not in groups:
                groups[flag.group] = parser.add_argument_group(flag.group)
            self._add(groups[flag.group], flag)

    def _add(self, group, flag: Flag) -> None:
        default = self.default(flag)
        help_text = f"{flag.help} (default: %(default)s)" if flag.help else "default: %(default)s"
        if flag.sets is not UNSET or flag.type is bool or (flag.type is None and isinstance(default, bool)):
            action = "store_true" if not default else argparse.BooleanOptionalAction
            group.add_argument(flag.name, action=action, default=default, help=help_text)
            return
        group.add_argument(flag.name, type=flag.type, default=default, choices=flag.choices, nargs=flag.nargs,
                           required=flag.required, help=help_text)

    def config_values(self, args, cls_name: str) -> dict:
        """The ``cls_name`` fields the rows set from ``args``; a switch not given leaves its field alone, and
        so does a row left at its default when another row names the same field (Megatron's other
        spelling of a flag, e.g. ``--rotary-scaling-factor`` beside ``--rope-scaling-factor``)."""
        values = {}
        for flag in self.flags:
            for target in flag.fields:
                owner, field = target.split(".")
                if owner != cls_name or not hasattr(args, flag.dest):
                    continue
                value = getattr(args, flag.dest)
                if flag.sets is UNSET:
                    if field not in values or value != self.default(flag):
                        values[field] = value
                elif value:
                    values[field] = flag.sets
        return values


class ArgumentParser(argparse.ArgumentParser):
    """The parser of every command: a bad flag raises ValueError (one error line, exit 2, from
    ``megalite.cli.run_cli``) instead of printing usage; no abbreviated flags."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise ValueError(message)


PARALLEL = "parallelism"

SHARED_FLAGS = FlagTable((
    Flag("--tensor-model-parallel-size", PARALLEL, default=1, type=int),
    Flag("--pipeline-model-parallel-size", PARALLEL, default=1, type=int),
    Flag("--context-parallel-size", PARALLEL, default=1, type=int,
         help="split every sequence over this many ranks (2*cp load-balanced chunks)"),
    Flag("--expert-model-parallel-size", PARALLEL, default=1, type=int),
    Flag("--expert-tensor-parallel-size", PARALLEL, type=int, help="None: the tensor-parallel size"),
    Flag("--save", "checkpoints, evaluation and logging", help="directory to save checkpoints to; None: no saving"),
    Flag("--load", "checkpoints, evaluation and logging", help="directory to load a checkpoint from; None: no loading"),
))
"""Rows that commands below the trainer share too (``python -m megalite.topology``, the server)."""
