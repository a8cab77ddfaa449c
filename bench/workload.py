"""The questions the engine and server benchmarks send (over the bundled demo knowledge base)."""

QUESTIONS = [
    "Which release fixed error E1234 and who approved it?",
    "Who approved the release of Helios Gateway that fixed error E2071?",
    "Which office does the person who approved Helios Gateway 4.2.1 work from?",
    "What priority does the Northwind Logistics contract give to data loss in the request journal?",
]


def load_synth(path: str, prog: str):
    """``(examples, corpus)`` of a dataset file (``rig synth``'s splits: the folder holds corpus.jsonl),
    or None after saying on stderr what is wrong and how to write the benchmark."""
    import sys

    from rig_decode.eval.datasets import DatasetError, load_dataset

    try:
        return load_dataset(path)
    except DatasetError as e:
        print(f"{prog}: {e} (write the synthetic benchmark with: rig synth --out out/synth)", file=sys.stderr)
        return None
