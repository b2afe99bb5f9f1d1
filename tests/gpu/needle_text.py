"""The long-context needle question of the end-to-end test (also asked through the transformers
adapter by bench/needle_transformers.py): one passphrase a third of the way into ~2.6K tokens of
filler."""

NEEDLE = "The secret passphrase is tangerine-42."
FILLER = (
    "The committee met on Tuesday to review the quarterly budget, the parking rules and the "
    "schedule for the spring cleaning of the archive rooms. "
)


def question() -> str:
    hay = FILLER * 100
    cut = len(hay) // 3
    return hay[:cut] + NEEDLE + " " + hay[cut:] + "\nWhat is the secret passphrase?"
