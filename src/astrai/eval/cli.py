"""`astrai eval`: exact match on prompt records, lm-eval tasks in-process, or perplexity.

Three modes, one per run: `--data F` (exact.py: greedy replies to prompt records scored by a
verifier), `--tasks T1,T2` (lm-evaluation-harness tasks on the engine through harness.py's
adapter; lm-eval's table on stdout, its results dict in `--output`), `--perplexity F`
(perplexity.py: rolling-window log-likelihood of a text or JSONL file, as JSON). lm-eval is an
optional extra and is imported only by `--tasks`. Errors are one line on stderr, exit 2. Flag values
are typed by `astrai.flags`' one rule (`--limit` is `int | float`: a count, or a fraction).
"""

from __future__ import annotations

import difflib
import json
import sys
from typing import Any

from astrai.data.tasks import SCORERS, no_answers_warning
from astrai.flags import ArgumentParser, value_type
from astrai.model.manifest import VERIFY_HELP

INSTALL_HINT = 'lm-eval is not installed; install the eval extra: pip install -e ".[eval]"'


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="astrai eval", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model or checkpoint directory, or a run's ckpt_dir "
                        "(its newest complete checkpoint)")
    parser.add_argument("--verify", action="store_true", default=None, help=VERIFY_HELP)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--data", help="JSONL prompt records with 'messages' and 'answer' (exact match)")
    mode.add_argument("--tasks", help="comma-separated lm-eval task names (or groups, tags, patterns)")
    mode.add_argument("--perplexity", help="text file, or JSONL with 'text' records: rolling-window perplexity")
    parser.add_argument("--limit", type=value_type("limit", int | float), default=None,
                        help="evaluate only the first N records (lm-eval: per task; a float < 1 is a fraction)")
    parser.add_argument("--max_tokens", type=value_type("max_tokens", int), default=16, help="--data: reply tokens at most")
    parser.add_argument("--match", choices=list(SCORERS), default="exact",
                        help="--data: exact: the reply is the answer (default); final_number: its last number is")
    lm = parser.add_argument_group("lm-eval tasks (--tasks)")
    lm.add_argument("--include_path", default=None, help="folder of local task YAMLs (lm-eval's include_path)")
    lm.add_argument("--num_fewshot", type=value_type("num_fewshot", int), default=None, help="few-shot examples per prompt")
    lm.add_argument("--batch_size", type=value_type("batch_size", int), default=64, help="requests per engine batch (also --perplexity)")
    lm.add_argument("--apply_chat_template", action="store_true", help="render prompts with the model's chat template")
    lm.add_argument("--output", default=None, help="write lm-eval's results dict to this JSON file")
    lm.add_argument("--log_samples", action="store_true", help="keep every request and response in --output")
    lm.add_argument("--seed", type=value_type("seed", int), default=None,
                    help="one seed for lm-eval's python, numpy, torch and few-shot draws (default: lm-eval's)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tasks is not None:
        return _run_tasks(args)
    from astrai.model.lora import split_adapter
    from astrai.model.manifest import check_model_dir, model_argument

    try:
        # a Hub id -> its cached snapshot directory; a run's ckpt_dir -> its newest checkpoint
        args.model = model_argument(args.model, "astrai eval")
        args.model, args.lora = split_adapter(args.model, None, "astrai eval")  # a LoRA checkpoint: on its base
        check_model_dir(args.model, verify=args.verify)
        if args.lora:
            check_model_dir(args.lora, verify=args.verify)
        if args.perplexity is not None:
            return _run_perplexity(args)
        if isinstance(args.limit, float):
            raise ValueError(f"--limit {args.limit} must be a whole number of records with --data")
        return _run_exact(args)
    except BrokenPipeError:  # `| head` stopped reading: the dispatcher (astrai/cli.py) ends quietly
        raise
    except (OSError, ValueError) as err:  # a damaged model (ManifestError, HFFormatError), a broken file
        return _fail(err)


def _run_exact(args: Any) -> int:
    from astrai.eval.exact import evaluate_model, read_prompt_records
    from astrai.infer.llm import LLM

    records = read_prompt_records(args.data, args.limit)
    if (warning := no_answers_warning([r["answer"] for r in records], args.data)) is not None:
        print(f"astrai eval: {warning}", file=sys.stderr)
    llm = LLM(args.model, **({"lora": args.lora} if args.lora else {}))
    result = evaluate_model(llm, records, args.max_tokens, match=args.match, source=args.data)
    if result.num_skipped:
        print(f"astrai eval: warning: skipped {result.num_skipped} of {result.num_total} prompts of {args.data} "
              f"longer than the model's max_model_len {llm.engine.max_model_len} tokens (counted wrong); shorten "
              "them or evaluate a model with a longer context", file=sys.stderr)
    print(json.dumps({"match": args.match, "accuracy": result.accuracy, "num_correct": result.num_correct,
                      "num_total": result.num_total, "num_skipped": result.num_skipped,
                      "tokens_per_s": round(result.tokens_per_s, 1), "samples": result.samples}, indent=2))
    return 0


def _fail(err: BaseException | str) -> int:
    message = " ".join(str(err).split())  # one line, whatever the library put in it
    print(f"astrai eval: {message}", file=sys.stderr)
    return 2


def _run_perplexity(args: Any) -> int:
    from astrai.eval.perplexity import perplexity, read_documents
    from astrai.eval.scoring import Scorer, scoring_engine

    documents = read_documents(args.perplexity)
    if args.limit is not None:
        documents = documents[: int(args.limit)]
    engine = scoring_engine(args.model, **({"lora": args.lora} if args.lora else {}))
    if engine.tokenizer is None:
        raise ValueError(f"--model {args.model} has no tokenizer.json; perplexity needs the model's tokenizer")
    print(json.dumps(perplexity(Scorer(engine, args.batch_size), engine.tokenizer, documents), indent=2))
    return 0


def _run_tasks(args: Any) -> int:
    try:
        import lm_eval
        from lm_eval.utils import handle_non_serializable, make_table
    except ImportError:
        return _fail(INSTALL_HINT)
    try:
        task_names = [t.strip() for t in args.tasks.split(",") if t.strip()]
        if not task_names:
            raise ValueError("--tasks is empty; give lm-eval task names, e.g. --tasks arc_easy,hellaswag")
        task_manager = _task_manager(task_names, args.include_path)
        from astrai.eval.harness import AstraiLM
        from astrai.model.lora import split_adapter
        from astrai.model.manifest import check_model_dir, model_argument

        model_dir, lora = split_adapter(model_argument(args.model, "astrai eval"), None, "astrai eval")
        check_model_dir(model_dir, verify=args.verify)
        if lora:
            check_model_dir(lora, verify=args.verify)
        model = AstraiLM(pretrained=model_dir, batch_size=args.batch_size, **({"lora": lora} if lora else {}),
                         seed=args.seed)
        seeds = {} if args.seed is None else {"random_seed": args.seed, "numpy_random_seed": args.seed,
                                              "torch_random_seed": args.seed, "fewshot_random_seed": args.seed}
        try:
            results = lm_eval.simple_evaluate(
                model=model, tasks=task_names, num_fewshot=args.num_fewshot, limit=args.limit,
                task_manager=task_manager, log_samples=args.log_samples, apply_chat_template=args.apply_chat_template,
                **seeds)
        except (ValueError, KeyError, IndexError, TypeError) as err:
            # lm-eval fails deep inside on a document without usable choices: name the task and document
            from astrai.eval.task_checks import bad_choices

            problem = bad_choices(task_names, task_manager)
            if problem is None and isinstance(err, IndexError | TypeError):
                raise  # not the data: a bug, kept with its traceback
            return _fail(problem or err)
    except (OSError, ValueError, KeyError) as err:
        return _fail(err)
    if not args.log_samples:
        results.pop("samples", None)
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    if args.output:
        text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


def _task_manager(task_names: list[str], include_path: str | None) -> Any:
    """lm-eval's TaskManager that knows every name: the include_path folder alone when it has
    them all (indexing lm-eval's thousands of built-in tasks takes seconds), else with built-ins."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if not _missing(local, task_names):
            return local
    manager = TaskManager(include_path=include_path)
    missing = _missing(manager, task_names)
    if missing:
        hint = ("" if include_path is None else f" (nor in --include_path {include_path})")
        if include_path is not None:
            from astrai.eval.task_checks import damaged_task_files

            damaged = damaged_task_files(include_path)
            if damaged:  # lm-eval skipped them without a word: the likely reason a task is not found
                more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
                hint += f"; {damaged[0]}{more}, so lm-eval skipped it: fix that file"
        known = list(manager.all_tasks)
        close = [f"{name}: did you mean {m[0]}?" for name in missing
                 if (m := difflib.get_close_matches(name, known, n=1, cutoff=0.75))]
        raise ValueError(f"Tasks not found: {', '.join(missing)}{hint}; " + "".join(c + " " for c in close)
                         + "for tasks of your own, point --include_path at a folder of task YAMLs that defines them")
    return manager


def _missing(manager: Any, task_names: list[str]) -> list[str]:
    return [name for name in task_names if not manager.match_tasks([name])]
