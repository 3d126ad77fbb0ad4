"""Chat prompts built here from templates x topics: the real draft's training set and held-out set.

The held-out topics never appear in training, so acceptance measured on them is acceptance on
requests the draft has not seen. Deterministic: the same seed gives the same prompts in the same
order.
"""

from __future__ import annotations

import random

TEMPLATES = (
    "What is {t}?",
    "Explain {t} in simple terms.",
    "Write a short paragraph about {t}.",
    "Give me three facts about {t}.",
    "How does {t} work?",
    "Why is {t} important?",
    "Describe the history of {t} in a few sentences.",
    "What are the pros and cons of {t}?",
    "Write a short story that involves {t}.",
    "Explain {t} to a ten-year-old.",
    "What should a beginner know about {t}?",
    "Summarize the main ideas of {t}.",
)

TRAIN_TOPICS = (
    "photosynthesis",
    "the water cycle",
    "black holes",
    "the Roman Empire",
    "machine learning",
    "volcanoes",
    "the French Revolution",
    "climate change",
    "vaccines",
    "the internet",
    "electric cars",
    "honey bees",
    "the moon landing",
    "democracy",
    "the stock market",
    "gravity",
    "the human heart",
    "coffee",
    "renewable energy",
    "earthquakes",
    "chess",
    "the printing press",
    "rainbows",
    "dinosaurs",
    "the Great Wall of China",
    "recycling",
    "sleep",
    "music theory",
    "the immune system",
    "plate tectonics",
    "solar panels",
    "ancient Egypt",
    "the Olympic Games",
    "bread baking",
    "computer programming",
    "tides",
    "the Industrial Revolution",
    "DNA",
    "hurricanes",
    "the solar system",
    "meditation",
    "the Amazon rainforest",
    "inflation",
    "bicycles",
    "the Renaissance",
    "antibiotics",
    "coral reefs",
    "the printing of money",
    "nuclear power",
    "gardening",
    "penguins",
    "the Silk Road",
    "smartphones",
    "the human brain",
    "deserts",
    "friendship",
    "the piano",
    "space telescopes",
    "ocean currents",
    "public libraries",
    "the theory of evolution",
    "airplanes",
    "tea",
    "glaciers",
    "the metric system",
    "social media",
    "wolves",
    "the Cold War",
    "batteries",
    "healthy eating",
    "the Pyramids of Giza",
    "electricity",
    "rivers",
    "cloud computing",
    "the violin",
    "mountain climbing",
    "the periodic table",
    "whales",
    "time zones",
    "the Moon",
    "video games",
    "recycling plastic",
    "Shakespeare",
    "bridges",
    "the speed of light",
    "trees",
    "online privacy",
    "the Vikings",
    "magnets",
    "soccer",
    "the Eiffel Tower",
    "robots",
    "clouds",
    "languages",
    "the postal service",
    "mushrooms",
    "cryptography",
    "jazz",
    "the Arctic",
    "elections",
    "wind turbines",
    "butterflies",
    "the Mars rovers",
    "first aid",
    "the calendar",
    "origami",
    "cheese",
)

HELD_OUT_TOPICS = (
    "the Sahara desert",
    "quantum computers",
    "owls",
    "the Byzantine Empire",
    "pottery",
    "lightning",
    "lighthouses",
    "octopuses",
    "submarines",
    "the camera",
    "rice farming",
    "the blood cells",
    "yoga",
    "the Nile river",
    "kites",
    "chocolate",
)


def messages_for(template: str, topic: str) -> list[dict[str, str]]:
    """One user turn."""
    return [{"role": "user", "content": template.format(t=topic)}]


def train_prompts(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """``count`` training conversations: every (template, topic) pair, shuffled by ``seed``."""
    pairs = [(tpl, topic) for topic in TRAIN_TOPICS for tpl in TEMPLATES]
    random.Random(seed).shuffle(pairs)
    return [messages_for(tpl, topic) for tpl, topic in pairs[:count]]


def held_out_prompts(count: int = 16) -> list[list[dict[str, str]]]:
    """``count`` conversations on the held-out topics, one template each (cycled)."""
    topics = HELD_OUT_TOPICS[:count]
    return [messages_for(TEMPLATES[i % len(TEMPLATES)], t) for i, t in enumerate(topics)]
