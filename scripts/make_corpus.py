"""Generate a small, deterministic, English-like corpus of children's stories.

The debug recipe must train on a fresh machine with no internet, so we make our own
data: a hand-written probabilistic grammar of short stories. It has enough structure
(templates, agreement, a consistent protagonist, counting, dialogue) that a tiny model's
loss falls well below the unigram entropy, and enough randomness that it is not periodic.

    python scripts/make_corpus.py --out data/stories.jsonl --num-docs 2600 --seed 1234

Only the stdlib is used, and all randomness comes from one random.Random(seed), so the
output is byte-for-byte reproducible (no set/hash ordering is ever relied upon).
"""

import argparse
import json
import os
import random
import sys

# --- Vocabulary --------------------------------------------------------------------
GIRLS = "Lily Mia Emma Sara Anna Lucy Ella Rosa Nora Zoe Ruby Maya Grace Ivy Luna Kate Daisy Alice".split()
BOYS = "Tom Ben Max Sam Leo Jack Finn Noah Owen Eli Jake Luke Theo Oscar Henry Milo Adam Hugo".split()
ANIMALS = "bunny fox bear cat dog duck mouse owl frog pig lion puppy kitten squirrel turtle bird".split()
TRAITS = "kind brave happy curious shy clever gentle little playful cheerful silly sleepy friendly quiet".split()
PLACES = (
    "park forest beach garden farm river hill lake town market school meadow "
    "cave zoo library bakery pond castle village mountain"
).split()
HOMES = [
    "in a small house",
    "in a big red house",
    "in a cozy cottage",
    "in a little hut",
    "in a tall tree",
    "in a hole under a tree",
    "in a blue house by the sea",
    "on a farm near the hills",
]
FAMILY = "mom dad grandma grandpa sister brother aunt uncle".split()
# singular -> plural; irregular plurals are listed so agreement stays correct.
OBJECTS = {
    "ball": "balls",
    "box": "boxes",
    "apple": "apples",
    "kite": "kites",
    "shell": "shells",
    "stone": "stones",
    "flower": "flowers",
    "book": "books",
    "hat": "hats",
    "cookie": "cookies",
    "leaf": "leaves",
    "feather": "feathers",
    "key": "keys",
    "cup": "cups",
    "toy": "toys",
    "boat": "boats",
    "egg": "eggs",
    "berry": "berries",
    "acorn": "acorns",
    "coin": "coins",
    "bell": "bells",
    "stick": "sticks",
    "drum": "drums",
    "sock": "socks",
    "button": "buttons",
    "basket": "baskets",
    "ribbon": "ribbons",
    "carrot": "carrots",
    "cake": "cakes",
    "pencil": "pencils",
    "balloon": "balloons",
    "star": "stars",
    "mitten": "mittens",
}
OBJ_NAMES = list(OBJECTS)
COLORS = "red blue green yellow pink purple orange white brown golden silver".split()
OBJ_ADJS = "big small shiny old new soft round tiny pretty funny".split()
NICE = "shiny soft pretty funny special".split()  # '"It is so ___."' needs fitting adjectives
ACTIVITIES = [
    "play outside",
    "sing songs",
    "dance",
    "read books",
    "draw pictures",
    "run fast",
    "climb trees",
    "jump in puddles",
    "bake cookies",
    "swim",
    "fly kites",
    "build towers",
    "pick flowers",
    "count the stars",
    "ride a bike",
    "plant seeds",
    "tell jokes",
    "paint",
    "look at the clouds",
    "play hide and seek",
]
GOOD_FEELINGS = "happy proud glad excited".split()
BAD_FEELINGS = "sad scared worried upset".split()
TIMES = [
    "One day",
    "One sunny morning",
    "One rainy afternoon",
    "One cold winter day",
    "One warm summer evening",
    "One windy day",
    "Early one morning",
    "One Saturday",
]
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
NUMBERS = "zero one two three four five six seven eight nine ten".split()
MORALS = [
    "it is good to share",
    "friends help each other",
    "being kind makes everyone happy",
    "it is okay to ask for help",
    "trying again is brave",
    "small things can be special",
    "it is fun to work together",
]


def a(word):
    """Indefinite article agreement: 'a ball' but 'an apple'."""
    return ("an " if word[0] in "aeiou" else "a ") + word


def make_character(rng, taken=()):
    """A character with a name, gender (for pronouns) and a kind (girl/boy/animal)."""
    female = rng.random() < 0.5
    name = rng.choice([n for n in (GIRLS if female else BOYS) if n not in taken])
    kind = rng.choice(ANIMALS) if rng.random() < 0.5 else ("girl" if female else "boy")
    p = dict(he="she", his="her", him="her") if female else dict(he="he", his="his", him="him")
    return dict(name=name, kind=kind, trait=rng.choice(TRAITS), **p)


def count_phrase(rng, n, obj):
    """'one shell', 'three shells' or '3 shells': number and noun must agree."""
    noun = obj if n == 1 else OBJECTS[obj]
    return f"{n if rng.random() < 0.3 and n > 1 else NUMBERS[n]} {noun}"


def cap(s):
    return s[0].upper() + s[1:]


def story(rng):
    """One story: intro, outing, discovery with counting, a friend, a problem, an ending."""
    c = make_character(rng)
    f = make_character(rng, taken=(c["name"],))
    N, F, he, his = c["name"], f["name"], c["he"], c["his"]
    obj, color, place = rng.choice(OBJ_NAMES), rng.choice(COLORS), rng.choice(PLACES)
    paras, s = [], []

    # Intro: who the protagonist is; the same name/pronouns are reused all story long.
    s.append(
        rng.choice(
            [
                f"Once upon a time, there was {a(c['trait'])} {c['kind']} named {N}.",
                f"There once was {a(c['trait'])} {c['kind']} called {N}.",
                f"{N} was {a(c['trait'])} {c['kind']}.",
            ]
        )
    )
    if rng.random() < 0.5:
        s.append(f"{cap(he)} was {rng.randint(3, 9)} years old.")
    s.append(f"{cap(he)} lived {rng.choice(HOMES)} with {his} {rng.choice(FAMILY)}.")
    act = rng.choice(ACTIVITIES)
    s.append(
        rng.choice(
            [f"{N} loved to {act}.", f"Every day, {N} liked to {act}.", f"More than anything, {N} loved to {act}."]
        )
    )
    paras.append(s)

    # Outing and discovery, with counting so numbers follow a learnable pattern.
    fam = rng.choice(FAMILY)
    s = [
        rng.choice(
            [
                f"{rng.choice(TIMES)}, {N} went to the {place}.",
                f"{rng.choice(TIMES)}, {N} and {his} {fam} walked to the {place}.",
            ]
        )
    ]
    n = rng.randint(1, 10)
    adj = rng.choice(OBJ_ADJS + COLORS)
    s.append(
        rng.choice(
            [
                f"There, {he} found {count_phrase(rng, n, obj).replace(' ', f' {adj} ', 1)}.",
                f"At the {place}, {he} saw {count_phrase(rng, n, obj).replace(' ', f' {adj} ', 1)}.",
            ]
        )
    )
    if n > 1 and rng.random() < 0.6:
        s.append(f"{cap(he)} counted them: {', '.join(NUMBERS[1 : n + 1])}.")
    if n == 1:
        s.append(f'"Look at this {obj}!" said {N}. "It is so {rng.choice(NICE)}."')
    elif n == 2:
        s.append(f'"Look at these two {OBJECTS[obj]}!" said {N}. "They are so {rng.choice(NICE)}."')
    else:
        s.append(f'"Wow!" said {N}. "I have never seen so many {OBJECTS[obj]}!"')
    paras.append(s)

    # A weekly list: repeated structure with a changing day and a growing number.
    if rng.random() < 0.3:
        start, k = rng.randint(0, 3), rng.randint(3, 4)
        thing = rng.choice(OBJ_NAMES)
        paras.append(
            [f"On {DAYS[start + i]}, {he} found {count_phrase(rng, i + 1, thing)}." for i in range(k)]
            + [f"By {DAYS[start + k - 1]}, {he} had {NUMBERS[k * (k + 1) // 2]} {OBJECTS[thing]}!"]
        )

    # The friend: introduced once, then a short dialogue.
    s = [f"Then {N} met {a(f['trait'])} {f['kind']} named {F}."]
    s.append(f'"Hello, {F}!" said {N}. "Do you want to play with me?"')
    s.append(
        rng.choice(
            [
                f'"Yes, please!" said {F}.',
                f'"I would love to," said {F} with a smile.',
                f'{F} nodded. "Okay, {N}. Let us play!"',
            ]
        )
    )
    paras.append(s)

    # A problem and its solution; which one depends on a coin flip per story.
    r = rng.random()
    bad, good = rng.choice(BAD_FEELINGS), rng.choice(GOOD_FEELINGS)
    if r < 0.33:
        which = f"{his} {obj}" if n == 1 else f"one of the {OBJECTS[obj]}"
        s = [
            f"But then, the wind blew {which} up into a tall tree.",
            f'{N} felt {bad}. "How will I get it down?" {he} asked.',
            f'{F} had an idea. "I can climb up and get it," said {F}.',
            f"{F} climbed the tree and gave the {obj} back to {N}.",
        ]
    elif r < 0.66:
        s = [
            f"Suddenly, {F} began to cry.",
            f'"What is wrong?" asked {N}.',
            f'"I lost my {color} {rng.choice(OBJ_NAMES)}," said {F}. "I feel so {bad}."',
            f"{N} and {F} looked under the rocks and behind the trees.",
            f"At last, {N} found it! {F} was so {good}.",
        ]
    else:
        s = [
            "Then it started to rain.",
            f"{N} and {F} ran to {a(rng.choice(['big', 'old', 'tall']))} tree to stay dry.",
            f"They shared {his} {OBJECTS[rng.choice(OBJ_NAMES)]} and told funny stories.",
            f"When the rain stopped, they saw a rainbow with {rng.randint(3, 7)} colors in the sky.",
        ]
    s.append(
        f'"Thank you, {N}!" said {F}. "You are a good friend."'
        if r >= 0.33
        else f'"Thank you, {F}!" said {N}. "You are a good friend."'
    )
    paras.append(s)

    # Ending: one of a few closing lines, sometimes with a moral.
    s = [
        rng.choice(
            [
                f"From that day on, {N} and {F} were best friends.",
                f"That night, {N} went to bed with a big smile.",
                f"{N} went home and told {his} {rng.choice(FAMILY)} all about {F}.",
                f"{N} and {F} played at the {place} until the sun went down.",
            ]
        )
    ]
    if rng.random() < 0.5:
        s.append(f"{N} learned that {rng.choice(MORALS)}.")
    if rng.random() < 0.3:
        s.append("The end.")
    paras.append(s)
    return "\n\n".join(" ".join(p) for p in paras)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="data/stories.jsonl")
    ap.add_argument("--num-docs", type=int, default=2600, help="default gives about 2 MB")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    nbytes = 0
    # newline="\n" so the bytes do not depend on the platform.
    with open(args.out, "w", encoding="utf-8", newline="\n") as fh:
        for i in range(args.num_docs):
            line = json.dumps({"text": story(rng)}, ensure_ascii=False) + "\n"
            fh.write(line)
            nbytes += len(line.encode("utf-8"))
            if args.num_docs >= 100_000 and (i + 1) % (args.num_docs // 10) == 0:  # progress for big corpora
                print(f"  {i + 1}/{args.num_docs} docs, {nbytes / 1e6:.1f} MB", file=sys.stderr, flush=True)
    print(f"wrote {args.num_docs} docs, {nbytes} bytes ({nbytes / 1e6:.2f} MB) to {args.out}")


if __name__ == "__main__":
    main()
