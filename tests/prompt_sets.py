"""Varied prompts for exactness tests (written for this project): chat, reasoning, code,
one-word greetings and long inputs, as chat-templated text for the default model."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

CHAT = [
    "What is the capital of France?",
    "How do I reset my password if I no longer have access to my email?",
    "My order arrived damaged. What should I do?",
    "Can you recommend a good book about the history of science?",
    "What are three tips for sleeping better?",
    "Translate 'good morning, how are you?' into Spanish.",
    "Quelle est la plus haute montagne d'Europe ?",
    "Explain what a black hole is to a ten year old.",
]
REASONING = [
    "If a train travels 60 km in 45 minutes, what is its average speed in km/h?",
    "Alice is older than Bob, and Bob is older than Carol. Who is the youngest?",
    "A shop sells pens at 3 for 2 euros. How much do 12 pens cost?",
    "What is 17 multiplied by 23? Show your steps.",
    "Is 91 a prime number? Explain.",
    "If today is Wednesday, what day will it be in 10 days?",
]
CODE = [
    "Write a Python function that checks whether a string is a palindrome.",
    "def fibonacci(n):",
    "Write a SQL query that counts orders per customer.",
    "Explain what this does: [x * x for x in range(10) if x % 2 == 0]",
    "Write a bash command that finds all .txt files modified in the last day.",
    "How do I reverse a linked list in C?",
]
GREETINGS = ["Hi", "Hello", "Thanks!", "Bonjour", "Hey there", "Good morning"]
LONG = [
    "Here is a short story opening: The lighthouse keeper had not seen a ship in eleven days. Each morning "
    "he climbed the one hundred and twelve steps, polished the great lens, and wrote the same line in his "
    "logbook: no vessels sighted, weather fair. On the twelfth morning the fog came in thick and low, and "
    "with it a sound he had never heard before, a slow bell ringing somewhere out on the water. Continue the story.",
    "Summarize the following notes from a team meeting. The release is delayed by one week because the "
    "payment provider changed its API. Marketing will move the launch email. Support needs a new FAQ entry "
    "about refunds. The design team finished the new onboarding screens and wants feedback by Friday. "
    "Two engineers will be on holiday next week, so code review may be slower than usual.",
    "Compare renewable energy sources: solar panels convert sunlight directly into electricity and work best "
    "in sunny regions; wind turbines need steady wind and are often placed offshore; hydroelectric dams "
    "provide stable output but change river ecosystems; geothermal plants are reliable but only possible in "
    "certain geological areas. Which would you recommend for a small island, and why?",
    "I am planning a three day trip to Rome with my parents, who cannot walk long distances. We like art, "
    "food and history, and we would prefer to avoid big crowds. Please suggest a plan for each day, with "
    "short walks, places to rest, and one good restaurant recommendation per day.",
]
CLASSES = {"chat": CHAT, "reasoning": REASONING, "code": CODE, "greeting": GREETINGS, "long": LONG}
ALL = [(name, prompt) for name, prompts in CLASSES.items() for prompt in prompts]


def chat_text(tokenizer: PreTrainedTokenizerBase, prompt: str, system: str | None = None) -> str:
    """The prompt as one user turn of the model's chat template (after `system`), ready for generation."""
    turns = [{"role": "system", "content": system}] if system is not None else []
    text = tokenizer.apply_chat_template([*turns, {"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    assert isinstance(text, str)
    return text
