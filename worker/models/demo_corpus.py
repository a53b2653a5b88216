"""A fixed, self-contained training corpus for the demo model's BPE tokenizer.

Everything is built from text in this file plus a ``random.Random(1234)`` stream driven only by methods whose output
is stable across CPython 3.x releases (``choice``, ``randint``, ``random``, ``getrandbits``), so the corpus, and with
it the trained tokenizer, is the same on every machine.
"""

from __future__ import annotations

import random

_PROSE = [
    """A cache is a promise that work done once will not be done again. The promise is cheap to make and expensive \
to keep: every entry takes memory, every lookup takes time, and every stale entry is a small lie waiting to be \
told. The art of caching is mostly the art of forgetting well. Keep what is likely to be asked for again, drop \
what is not, and never return an answer that no longer matches the question.""",
    """When a language model reads a prompt it computes, for every token and every layer, a key and a value. These \
tensors are the model's working memory. If two requests begin with the same system prompt, the keys and values for \
that shared prefix are identical, so a server that remembers them can skip the expensive part of the prefill and \
start generating sooner. Routing each request to the machine that already holds its prefix turns a local trick \
into a property of the whole cluster.""",
    """A GPU is a crowd of small workers that prefer to move in step. Give them a large matrix and they are \
glorious; give them a thousand tiny, unrelated jobs and they spend most of their time waiting for memory. Batching \
requests together is how a serving system keeps the crowd busy, and paging the key-value cache into fixed-size \
blocks is how it keeps memory from fragmenting as sequences grow and finish at different times.""",
    """Decoding is a loop. Take the last token, run one step of the model, turn the logits into a choice, append \
it, and go around again until a stop condition holds: an end-of-text token, a stop string, or a length limit. \
Greedy decoding always takes the most likely token, which makes it easy to test, because two correct \
implementations should agree token for token as long as the top two logits are not nearly tied.""",
    """To make a good soup, start with onions cooked slowly in butter until they are soft and sweet. Add garlic for \
a minute, then carrots, celery, and a handful of lentils. Pour in stock, season with salt, pepper, and a bay leaf, \
and let it simmer for forty minutes. Taste it before serving; a squeeze of lemon at the end wakes everything up. \
Leftovers taste better the next day, which is the kitchen's own version of a warm cache.""",
    """The forecast for tomorrow calls for low clouds in the morning, clearing by noon, with a light breeze from \
the west. Temperatures will reach nineteen degrees in the afternoon and fall to eight overnight. On the coast, fog \
may linger until late morning. Later in the week a cold front will bring showers, gusty winds, and perhaps the \
first snow of the season on the higher passes, so keep an umbrella and a warm coat near the door.""",
    """Good tests are small, fast, and boring. They set up exactly what they need, check one idea, and clean up \
after themselves. A deterministic test model helps: with fixed random weights and a fixed tokenizer, the same \
prompt always produces the same tokens, so a failure means the code changed, not the dice. When a test does fail, \
its message should say what was expected, what happened instead, and where to look next.""",
    """Tokenizers split text into pieces that a model can count. A byte-level tokenizer starts from the two hundred \
and fifty-six possible bytes, so nothing is ever out of vocabulary, and then learns to merge frequent pairs into \
longer pieces. Common words become single tokens, rare words are spelled out in fragments, and an emoji or a \
Chinese character simply costs a few more tokens than an English word does.""",
    """The old train station had been turned into a market. On Saturday mornings farmers sold apples, cheese, \
bread, and honey under the iron roof, while a violinist played near the clock that had stopped at twenty past \
four many years ago. Children ran between the stalls, dogs waited patiently by the doors, and the smell of \
roasted coffee drifted all the way to the platform where the trains no longer stopped.""",
    """Scheduling is a negotiation between fairness and throughput. A scheduler that always serves the shortest \
job first finishes the most work but can starve long requests; one that serves strictly in arrival order is fair \
but wastes capacity. Practical systems mix the two: they admit new requests while memory allows, preempt the \
newest sequences when it runs out, and give every tenant a bounded share so no single client can take the cluster.""",
    """Latency has a shape. The time to the first token depends on the prompt length and on whether its prefix is \
cached; the time between later tokens depends on the batch size and the model's memory bandwidth. Users feel the \
first number as responsiveness and the second as reading speed. A dashboard that shows only averages hides both, \
so measure percentiles, and measure them per tenant.""",
    """Rain arrived just after dinner, drumming on the skylight and filling the gutters within minutes. The cat \
retreated under the sofa, the kettle went on, and someone found a deck of cards in the drawer with the candles. \
By midnight the storm had moved east, leaving the streets shining under the lamps and the air smelling of wet \
stone and cut grass.""",
    """Consistent hashing gives each key a home on a ring of servers. When a server joins or leaves, only the keys \
next to it move, which keeps caches warm during scaling. Prefix-aware routing goes one step further: it hashes \
blocks of tokens, not whole prompts, so that requests sharing a long beginning land together even when their \
endings differ. The trick is to balance that affinity against load, because the hottest prefix can also be the \
busiest machine.""",
    """Bread needs four things: flour, water, salt, and time. Mix them, let the dough rest, fold it a few times \
over an hour, and then leave it overnight in a cool place. In the morning shape it gently, let it rise once more, \
and bake it in a very hot oven with steam for the first twenty minutes. Patience does more for the crust than \
any special tool.""",
    """Every number in a neural network is stored with limited precision. Adding the same values in a different \
order can change the last bit of the result, and on a GPU the order depends on how the work is split among \
threads. Those tiny differences are harmless on their own, but they can flip a greedy choice when two candidates \
are almost equally likely, which is why careful comparisons look at logit gaps and not only at token ids.""",
    """Café owners in the old quarter say the naïve tourists order a latte at dinner, while the locals prefer an \
espresso, a glass of water, and a slice of crème brûlée. In Zürich the trams run on time; in São Paulo the \
traffic has its own weather; in Kraków the square fills with pigeons and accordion music. Façade, résumé, \
jalapeño, smörgåsbord, Ångström: borrowed words keep their accents, and a good tokenizer keeps them too.""",
]

_NAMES = [
    "Ada",
    "Ben",
    "Chen",
    "Dana",
    "Eli",
    "Farah",
    "Gus",
    "Hana",
    "Ivan",
    "Jun",
    "Kira",
    "Luis",
    "Mira",
    "Nils",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tara",
    "Uma",
    "Viktor",
    "Wen",
    "Yara",
    "Zoe",
]
_SUBJECTS = [
    "the scheduler",
    "the router",
    "a worker",
    "the cache",
    "the model",
    "the tokenizer",
    "the cluster",
    "each replica",
    "the baker",
    "my neighbour",
    "the old dog",
    "a small team",
    "the weather service",
    "the kernel",
    "the allocator",
    "the benchmark",
    "the operator",
    "the gardener",
    "our client",
    "the queue",
    "the chef",
    "a student",
    "the library",
    "the river",
    "the night train",
    "the server",
    "the database",
]
_VERBS = [
    "reads",
    "writes",
    "evicts",
    "loads",
    "counts",
    "routes",
    "caches",
    "measures",
    "prepares",
    "bakes",
    "waters",
    "schedules",
    "compresses",
    "streams",
    "returns",
    "rejects",
    "forgets",
    "remembers",
    "tracks",
    "splits",
    "merges",
    "copies",
    "checks",
    "repairs",
    "paints",
    "cooks",
    "watches",
    "sorts",
    "updates",
    "restarts",
]
_OBJECTS = [
    "the prompt",
    "a block of tokens",
    "the key-value cache",
    "every request",
    "the logits",
    "a fresh loaf",
    "the tomatoes",
    "the forecast",
    "a batch of sequences",
    "the hash table",
    "the weights",
    "a long document",
    "the config file",
    "the soup",
    "the garden beds",
    "the metrics",
    "the error log",
    "a cold start",
    "the attention mask",
    "the output buffer",
    "the window frames",
    "the memory pool",
    "the shopping list",
    "the rope scaling factor",
    "the last layer",
    "the greedy choice",
    "the stop string",
    "a warm prefix",
]
_ADVERBS = [
    "quickly",
    "slowly",
    "carefully",
    "twice",
    "again",
    "quietly",
    "eagerly",
    "lazily",
    "exactly",
    "almost",
    "rarely",
    "often",
    "gently",
    "reliably",
    "at once",
    "in parallel",
    "in order",
    "by hand",
    "on purpose",
]
_PLACES = [
    "in the morning",
    "after lunch",
    "before the storm",
    "on the second GPU",
    "in the kitchen",
    "near the coast",
    "during the benchmark",
    "under heavy load",
    "at midnight",
    "in the garden",
    "on every node",
    "behind the firewall",
    "in the test suite",
    "on a rainy day",
    "between two batches",
    "at the market",
]
_ADJECTIVES = [
    "small",
    "large",
    "warm",
    "cold",
    "quiet",
    "noisy",
    "bright",
    "dark",
    "fast",
    "slow",
    "stale",
    "fresh",
    "careful",
    "clever",
    "empty",
    "full",
    "green",
    "golden",
    "sharp",
    "heavy",
    "light",
    "simple",
    "tiny",
]
_NOUNS = [
    "block",
    "token",
    "layer",
    "head",
    "batch",
    "prefix",
    "tenant",
    "request",
    "kernel",
    "tensor",
    "queue",
    "apple",
    "onion",
    "cloud",
    "river",
    "window",
    "bridge",
    "garden",
    "lamp",
    "table",
    "engine",
    "signal",
]
_CONNECTIVES = ["because", "although", "while", "so", "but", "and then", "until", "unless", "whenever"]
_WEATHER = ["sunny", "cloudy", "rainy", "windy", "foggy", "snowy", "stormy", "mild", "humid", "freezing"]
_CITIES = [
    "Lisbon",
    "Oslo",
    "Nairobi",
    "Lima",
    "Osaka",
    "Toronto",
    "Cairo",
    "Dublin",
    "Hanoi",
    "Perth",
    "Quito",
    "Zürich",
    "Kraków",
    "São Paulo",
    "Reykjavík",
    "Montréal",
]
_IDENTS = [
    "block_size",
    "num_blocks",
    "seq_len",
    "token_ids",
    "hidden",
    "logits",
    "kv_cache",
    "prefix_hash",
    "request",
    "tenant_id",
    "max_tokens",
    "temperature",
    "batch",
    "scores",
    "weights",
    "offset",
    "count",
    "result",
    "node",
]
_FUNCS = [
    "allocate",
    "free",
    "lookup",
    "insert",
    "evict",
    "schedule",
    "forward",
    "decode",
    "encode",
    "hash_block",
    "route",
    "load_config",
    "sample",
    "step",
    "flush",
    "merge",
    "split",
    "normalize",
    "softmax",
    "matmul",
]
# A broad everyday vocabulary, so that whole common words (with and without a leading space) earn their own tokens.
_WORDS = """
about above absent accept account across action active actual address admit adult advice afford afraid after
afternoon again against agency agenda agree ahead airport alarm album alive allow almost alone along already
although always amazing among amount ancient anger angle animal answer anxious anyone anything apart appear
approach approve argue arrive article artist aside asleep attach attempt attend attract audience author autumn
average avoid awake award aware backward balance balcony banana bandwidth basket battery beach beautiful become
bedroom before begin behave behind belief believe belong below benefit beside better between beyond bicycle
billion biology birthday blanket blossom border borrow bottle bottom branch brave breakfast breath brick brief
bright bring broken brother brush bucket budget buffer build burden butter button cabinet cable calendar camera
campus candle canvas capable capital captain carbon career careful carpet carrot castle casual catalog ceiling
celebrate center century certain chair chalk challenge chamber champion change channel chapter charge charity
cheap cheese cherry chicken chimney choice choose church circle citizen civil claim classic climate climb clinic
clock close clothes cloudy coast coffee collect college colony column combine comfort command comment common
company compare compile complex compute concert confirm connect consider contain content context continue
control convert copper corner correct cotton couch country couple courage course cousin cover craft crash
create credit crisis cross crowd crystal culture cupboard curious current curtain cushion custom cycle damage
dance danger daughter debate decade decide declare decline deeply default defend define degree delay deliver
demand depend deploy deposit depth derive design desert desire detail detect develop device dialog diamond
diary differ digital dinner direct discover discuss disease display distance divide doctor domain double
dragon drama drawer dream dress drift driver during dynamic eager early earth easily eastern economy edition
editor effect effort eight either elbow elder electric element eleven elegant emerge emotion empire employ
enable energy engage enjoy enormous enough ensure entire entry envelope episode equal escape essay estate
evening event evidence exact example excite exercise exhibit expand expect expert explain explore export
express extend extra fabric factor factory failure fairly family famous farmer fashion father feature federal
feeling fellow fence festival fiction field fifteen figure filter final finance finger finish fiscal flavor
flight float flower follow forest forget formal format fortune forward fossil foster fountain fourteen fraction
frame freedom freeze friend frozen fruit future galaxy gallery garage garlic gather general gentle genuine
gesture giant ginger glance global glory govern gradual grammar grandmother granite graph gravity great grocery
ground growth guitar habit hammer handle happen harbor hardware harvest health healthy height helmet hidden
highway history hobby holiday hollow honest horizon hospital hotel hundred hunger husband ignore image immune
impact import improve include income indeed index indicate indoor infant inform initial injury inner insect
inside install instance instead integer intend interest invite island itself jacket journal journey judge
juice jungle justice kettle keyboard kidney kitchen knife ladder language laptop latency launch lawyer leader
league lecture legal lemon length lesson letter level liberty library license limit liquid listen little
lively lobster local lonely lottery loyal luggage lunch machine magnet maintain manage mango manual marble
margin market master matrix matter meadow measure medium melody member memory mention merchant message metal
method middle midnight million mineral minute mirror mission mistake mixture mobile modern moment monitor
monkey month morning mother motion mountain muscle museum music mystery narrow nation native nature nearby
needle negative nephew network neutral never nickel nineteen noble normal notable notice novel number object
obtain ocean october offer office olive online option orange orbit orchard ordinary organ origin outcome outdoor
output oxygen package paddle palace panel paper parade parent parrot partner patience pattern payment peanut
pencil people pepper perfect perhaps permit person phrase physics piano picnic picture pillow pilot planet
plastic platform pleasant plenty pocket poetry police polite portion positive potato powder practice praise
predict prefer present pretty prevent price primary prince printer priority private problem process produce
profile program project promise proper protect proud provide public pumpkin puppy purple puzzle quality quarter
question quick rabbit radio random rapid rather reach ready reason recall receive recipe record reduce reflect
region regular relax release remain remote remove repeat replace report rescue resource respond result retire
return reveal review reward rhythm ribbon rifle ripple ritual rocket rubber ruler runway saddle safety salad
salmon sample sandwich satisfy sauce scatter scheme school science scissors screen script season second secret
section select senior sensor series service session settle seven shadow shallow shelter shoulder shrimp signal
silent silver similar simple single sister sketch skill slender slogan smooth snack social socket soldier
solid someone source spatial special spider spirit splendid sponsor spring square stable stadium station
status steady stomach storage strategy street strong student studio submit subway sudden sugar summer sunset
supply support surface surprise switch symbol system tablet talent target teacher temple tennis thermal
thirteen thousand thunder ticket timber tissue title toast today together tomorrow tongue topic tornado
tourist tower traffic travel treasure triangle trouble trumpet tunnel turkey twelve twenty umbrella uncle
under unfold uniform unique update upgrade useful usual vacuum valley valve vanilla velvet vendor verify
version vessel victory village vintage violin virtual visual vitamin volume voyage wagon wallet walnut wander
warrior weekend welcome western whisper window winter wisdom witness wonder wooden worker worry yellow yesterday
young zebra
""".split()

_SYLLABLES = [
    "ka",
    "lo",
    "mir",
    "ta",
    "ven",
    "sho",
    "ri",
    "dan",
    "el",
    "qua",
    "bre",
    "no",
    "xi",
    "tor",
    "um",
    "pha",
    "gel",
    "sa",
    "vi",
    "ond",
    "ret",
    "zu",
    "ham",
    "ly",
    "cor",
    "ine",
    "bau",
    "fen",
    "ost",
    "wy",
]
_LEVELS = ["DEBUG", "INFO", "INFO", "INFO", "WARNING", "ERROR"]
_SYMBOLS = ["+", "-", "*", "//", "%"]

# About 410 KB in all: enough that all 4k BPE merges are of pairs seen at least twice, small enough to train in well
# under a second.
_N_SENTENCE_DOCS = 600
_N_CODE_DOCS = 300
_N_LOG_DOCS = 200
_N_NUMBER_DOCS = 200
_N_WORD_DOCS = 800


def _made_up_word(rng: random.Random) -> str:
    # Invented words give the trainer many distinct, moderately frequent character pairs to merge.
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))


def _sentence(rng: random.Random) -> str:
    kind = rng.randint(0, 6)
    if kind == 0:
        text = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ADVERBS)}"
    elif kind == 1:
        text = (
            f"{rng.choice(_NAMES)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}, "
            f"{rng.choice(_CONNECTIVES)} {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        )
    elif kind == 2:
        text = f"the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} is {rng.choice(_ADJECTIVES)} {rng.choice(_PLACES)}"
    elif kind == 3:
        text = (
            f"in {rng.choice(_CITIES)} it will be {rng.choice(_WEATHER)} with a high of {rng.randint(-5, 38)} "
            f"degrees and a {rng.randint(0, 100)} percent chance of rain"
        )
    elif kind == 4:
        text = (
            f"{rng.choice(_NAMES)} asked whether {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} "
            f"{rng.randint(2, 4096)} {rng.choice(_NOUNS)}s per second"
        )
    elif kind == 5:
        word = _made_up_word(rng)
        text = (
            f"the village of {word.capitalize()} sits {rng.choice(_PLACES)} beside the {rng.choice(_NOUNS)} "
            f"where {rng.choice(_NAMES)} sells {_made_up_word(rng)} and {_made_up_word(rng)}"
        )
    else:
        text = (
            f"after {rng.randint(1, 90)} minutes {rng.choice(_SUBJECTS)} {rng.choice(_ADVERBS)} "
            f"{rng.choice(_VERBS)} the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
        )
    end = "?" if kind == 4 else rng.choice([".", ".", ".", "!", ";"])
    return text[0].upper() + text[1:] + end


def _word_doc(rng: random.Random) -> str:
    # Loose, list-like text: each word appears often enough, in varied company, to be merged whole.
    words = [rng.choice(_WORDS) for _ in range(rng.randint(8, 20))]
    if rng.random() < 0.3:
        words[0] = words[0].capitalize()
        return " ".join(words) + "."
    return f"{rng.choice(['Notes', 'Keywords', 'Tags', 'Shopping list', 'Topics'])}: " + ", ".join(words) + "."


def _sentence_doc(rng: random.Random) -> str:
    return " ".join(_sentence(rng) for _ in range(rng.randint(2, 6)))


def _code_doc(rng: random.Random) -> str:
    func, a, b = rng.choice(_FUNCS), rng.choice(_IDENTS), rng.choice(_IDENTS)
    kind = rng.randint(0, 3)
    if kind == 0:
        return (
            f"def {func}({a}: int, {b}: list[int]) -> int:\n"
            f"    total = 0\n"
            f"    for i in range({a}):\n"
            f"        total += {b}[i] {rng.choice(_SYMBOLS)} {rng.randint(1, 999)}\n"
            f"    return total\n"
        )
    if kind == 1:
        return (
            f'{{"{a}": {rng.randint(0, 65535)}, "{b}": [{rng.randint(0, 99)}, {rng.randint(0, 99)}], '
            f'"name": "{rng.choice(_NAMES).lower()}-{rng.randint(0, 9)}", "ok": {rng.choice(["true", "false"])}}}'
        )
    if kind == 2:
        return (
            f"if {a} > {rng.randint(0, 512)} and not {b}:\n"
            f"    {a} = {func}({a}, {b}={rng.randint(1, 64)})\n"
            f"else:\n"
            f'    raise ValueError(f"bad {a}: {{{a}!r}}")\n'
        )
    return (
        f"$ python -m kvgrid.{func} --{a.replace('_', '-')} {rng.randint(1, 256)} "
        f"--{b.replace('_', '-')}={rng.random():.3f} && echo done"
    )


def _log_doc(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(2, 5)):
        lines.append(
            f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:"
            f"{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d} {rng.choice(_LEVELS)} "
            f"worker-{rng.randint(0, 15)} req={rng.getrandbits(32):08x} {rng.choice(_FUNCS)} "
            f"{rng.choice(_IDENTS)}={rng.randint(0, 100000)} "
            f"hit_ratio={rng.random():.2f} latency_ms={rng.random() * 250:.1f}"
        )
    return "\n".join(lines)


def _number_doc(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(3, 8)):
        x, y = rng.randint(0, 999), rng.randint(1, 999)
        op = rng.choice(["+", "-", "*"])
        value = x + y if op == "+" else x - y if op == "-" else x * y
        parts.append(f"{x} {op} {y} = {value}")
    return "; ".join(parts) + "."


def demo_corpus() -> list[str]:
    """Return the demo tokenizer's training corpus: one string per document, about 410 KB of UTF-8 in total.

    The result is identical on every machine and CPython 3.11 patch release, so a tokenizer trained on it (with a
    deterministic trainer) is too.
    """
    rng = random.Random(1234)
    docs = list(_PROSE)
    docs += [_sentence_doc(rng) for _ in range(_N_SENTENCE_DOCS)]
    docs += [_code_doc(rng) for _ in range(_N_CODE_DOCS)]
    docs += [_log_doc(rng) for _ in range(_N_LOG_DOCS)]
    docs += [_number_doc(rng) for _ in range(_N_NUMBER_DOCS)]
    docs += [_word_doc(rng) for _ in range(_N_WORD_DOCS)]
    # The prose is the only natural text, so repeat it enough for its vocabulary to earn merges too.
    return docs + list(_PROSE) * 4
