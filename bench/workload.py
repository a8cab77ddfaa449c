"""The questions the engine and server benchmarks send (over the bundled demo knowledge base)."""

QUESTIONS = [
    "Which release fixed error E1234 and who approved it?",
    "Who approved the release of Helios Gateway that fixed error E2071?",
    "Which office does the person who approved Helios Gateway 4.2.1 work from?",
    "What priority does the Northwind Logistics contract give to data loss in the request journal?",
]
