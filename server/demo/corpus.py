"""A generator of synthetic chat dialogues: the demo model's whole training corpus.

Why synthetic: the demo model has a few million parameters and a few CPU-minutes of
training, so it can learn a small world well or a large one badly. Every sentence here
was written for this project (licence: the project's, Apache-2.0), so the corpus is
redistributable, needs no download, and is regenerated bit for bit from a seed.

The world: greetings, who the model is, what pagefleet is and how to serve a real model,
a few serving and Kubernetes concepts, simple facts (capitals, colours, animal sounds),
"hello" in other languages (multi-byte UTF-8 on purpose: the model must learn to emit
whole characters, and the server's streaming must never split them), short stories,
jokes, tool calls (hermes style: a `get_weather` / `get_time` call when the request
offers that tool, an answer from the tool's response, and a refusal when it offers
none), and a fallback that says honestly what a demo model cannot do. Dialogues may
have a system prompt (some of which rename the assistant) and earlier turns.

`dialogues(seed)` yields them forever as OpenAI-style `messages` lists (plus `tools`),
ready for the chat template; nothing here imports torch.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

Message = dict
Tool = dict


@dataclass
class Dialogue:
    messages: list[Message]
    tools: list[Tool] | None = None
    topic: str = ""
    meta: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- helpers

def pick(rng: random.Random, options: list[str] | tuple[str, ...]) -> str:
    return options[rng.randrange(len(options))]


def _user_noise(rng: random.Random, text: str) -> str:
    """Vary how people type: case, trailing punctuation, a leading 'hi', 'please'."""
    r = rng.random()
    if r < 0.2:
        text = text.lower()
    elif r < 0.25:
        text = text.upper() if len(text) < 30 else text
    if rng.random() < 0.25 and text[-1:] in "?.!":
        text = text[:-1]
    if rng.random() < 0.08:
        text = pick(rng, ("Hi! ", "Hey, ", "Hello. ", "Ok, ", "So, ")) + text
    if rng.random() < 0.05:
        text = text + pick(rng, (" Please.", " Thanks.", " :)"))
    return text


DEFAULT_NAME = "the pagefleet demo model"

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer briefly.",
    "You are a friendly assistant.",
    "You are a concise assistant. Keep your answers short.",
    "You are an assistant running on pagefleet.",
    "Be polite and helpful.",
    "You are a helpful, honest assistant.",
)
NAMES = ("Ada", "Max", "Luna", "Otto", "Iris", "Felix", "Nova", "Hugo", "Mira", "Leo",
         "Pip", "Zoe", "Sam", "Tess", "Kai", "Rosa", "Milo", "June", "Bea", "Finn")
NAMED_SYSTEM_PROMPTS = (
    "You are {name}, a helpful assistant.",
    "Your name is {name}.",
    "You are {name}. Be friendly.",
    "You are an assistant called {name}.",
)


@dataclass
class Ctx:
    """Per-dialogue facts that answers may depend on."""
    name: str = DEFAULT_NAME
    named: bool = False
    tools: tuple[str, ...] = ()

    @property
    def me(self) -> str:
        """How the assistant names itself mid-sentence."""
        return self.name

    @property
    def intro(self) -> str:
        if self.named:
            return f"I am {self.name}, a tiny demo model served by pagefleet."
        return "I am the pagefleet demo model, a tiny language model that runs on a CPU."


Turn = tuple[str, str]          # (user text, assistant text)
TopicFn = Callable[[random.Random, Ctx], Turn]


# --------------------------------------------------------------------------- topics

SERVE_HINT = (
    "For real answers, serve a real model with pagefleet serve MODEL.",
    "A real model, started with pagefleet serve MODEL, would answer much better.",
    "To get good answers, start pagefleet with a real model, for example pagefleet serve Qwen/Qwen2.5-7B-Instruct.",
)


def t_greeting(rng: random.Random, c: Ctx) -> Turn:
    user = pick(rng, ("Hello", "Hi", "Hey", "Hello!", "Hi there!", "Hey there", "Good morning",
                      "Good evening", "Good afternoon", "Hello there", "Greetings", "Yo",
                      "Hiya", "Howdy", "Hello, assistant", "Hi, I am new here"))
    hello = pick(rng, ("Hello!", "Hi!", "Hello there!", "Hi there!"))
    if user.lower().startswith("good "):
        hello = user.split()[0].capitalize() + " " + user.split()[1].lower() + "!"
    tail = pick(rng, ("How can I help you today?", "What would you like to talk about?",
                      "How can I help?", "Ask me anything, and I will do my best."))
    if rng.random() < 0.5:
        return user, f"{hello} {c.intro} {tail}"
    return user, f"{hello} {tail}"


def t_identity(rng: random.Random, c: Ctx) -> Turn:
    user = pick(rng, ("Who are you?", "What are you?", "Hello, who are you?", "Hi, who are you?",
                      "Tell me about yourself.", "Introduce yourself.", "Are you a real model?",
                      "Are you an AI?", "Are you ChatGPT?", "Which model are you?",
                      "What model is this?", "Hello, what are you?", "Who am I talking to?",
                      "Are you a human?", "How big are you?", "How were you trained?"))
    lead = "Hello! " if user.lower().startswith(("hello", "hi")) else ""
    size = pick(rng, (
        "I have only a few million parameters, and I was trained in a few minutes on a small set of example dialogues.",
        "I am very small: I know a few topics, and I was trained in a few minutes on a CPU.",
        "I was trained on a small set of example dialogues, so I only know a few topics.",
    ))
    if "human" in user:
        return user, f"No, I am not a human. {c.intro} {size}"
    if "ChatGPT" in user:
        return user, f"No, I am not ChatGPT. {c.intro} {size}"
    tail = pick(rng, ("", " " + pick(rng, SERVE_HINT), " I am here to show that the server works."))
    return user, f"{lead}{c.intro} {size}{tail}"


def t_name(rng: random.Random, c: Ctx) -> Turn:
    user = pick(rng, ("What is your name?", "What's your name?", "Do you have a name?",
                      "What should I call you?", "Tell me your name."))
    if c.named:
        return user, pick(rng, (f"My name is {c.name}.", f"I am {c.name}.",
                                f"You can call me {c.name}.")) + " " + pick(rng, (
            "How can I help you?", "I am a tiny demo model, so please be patient with me."))
    return user, pick(rng, ("I am the pagefleet demo model.", "My name is pagefleet demo.",
                            "You can call me the pagefleet demo model.")) + " " + pick(rng, (
        "I am a tiny language model that shows the server works.",
        "I am small, but the server that runs me is real."))


def t_how_are_you(rng: random.Random, c: Ctx) -> Turn:
    user = pick(rng, ("How are you?", "How are you doing?", "How is it going?", "Are you ok?",
                      "How do you feel?", "What's up?", "How are things?"))
    return user, pick(rng, (
        "I am fine, thank you! All my weights are loaded and the KV cache is ready.",
        "I am doing well, thank you. The server is up and ready for your requests.",
        "Very well, thanks for asking! How can I help you?",
        "I am good, thank you. It is a quiet day on the server.",
    ))


def t_capabilities(rng: random.Random, c: Ctx) -> Turn:
    user = pick(rng, ("What can you do?", "Help", "Help me", "How can you help me?",
                      "What do you know?", "What topics do you know?", "What are you good at?",
                      "What can I ask you?", "Can you help me?", "What should I ask you?"))
    return user, pick(rng, (
        "I can say hello, tell you about pagefleet, paged attention and Kubernetes, name a few capitals, tell a short story or a joke, and call a weather tool.",
        "I know a few small topics: pagefleet, the KV cache, batching, Kubernetes, some capitals and colors, short stories and jokes. I can also call tools.",
        "Ask me about pagefleet, about serving models, or about the capital of a country. I can also tell a short story.",
    )) + " " + pick(rng, SERVE_HINT)


def t_pagefleet(rng: random.Random, c: Ctx) -> Turn:
    user = pick(rng, ("What is pagefleet?", "Tell me about pagefleet.", "What is this server?",
                      "What does pagefleet do?", "Explain pagefleet.", "What is pagefleet for?",
                      "Why should I use pagefleet?", "What is this?"))
    return user, pick(rng, (
        "pagefleet is an inference server for large language models with an OpenAI-compatible API.",
        "pagefleet serves open-weight language models behind an OpenAI-compatible API.",
        "pagefleet is a server that runs language models and answers requests over an OpenAI-compatible API.",
    )) + " " + pick(rng, (
        "It uses paged attention, continuous batching and prefix caching, and its operator deploys models on Kubernetes.",
        "It takes the same flags as vLLM, so your launch lines and dashboards keep working.",
        "Its Kubernetes operator deploys models and scales them with the length of their queues.",
    ))


def t_serve_real(rng: random.Random, c: Ctx) -> Turn:
    model = pick(rng, ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B-Instruct",
                       "mistralai/Mistral-7B-Instruct-v0.3"))
    user = pick(rng, ("How do I serve a real model?", "How do I use a real model?",
                      "How do I start pagefleet with my own model?", "How do I run Qwen?",
                      "How do I run Llama?", "How do I load a model?", "How do I serve a model?",
                      "Can I run a bigger model?", "How do I get better answers?",
                      "How do I start the server?"))
    return user, pick(rng, (
        f"Give pagefleet serve the path of a model directory or a Hub id, for example: pagefleet serve {model}.",
        f"Run pagefleet serve with a model, for example pagefleet serve {model} --max-model-len 8192.",
        f"Start the server with a real model: pagefleet serve {model}. It takes the same flags as vLLM.",
    )) + " " + pick(rng, (
        "On a GPU it will be much faster than me.",
        "Then send your requests to the same API as now.",
        "Use pagefleet serve --help to see every flag.",
    ))


CONCEPTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "kv": (("What is the KV cache?", "Explain the KV cache.", "What is a KV cache?",
            "Why do we need a KV cache?"),
           ("The KV cache keeps the keys and values of every token that the model has already seen, so each new token does not recompute them.",
            "The KV cache stores the attention keys and values of past tokens. It makes each decoding step fast, but it uses a lot of memory.")),
    "paged": (("What is paged attention?", "Explain paged attention.", "How does paged attention work?",
               "Why is it called pagefleet?"),
              ("Paged attention splits the KV cache into small blocks, like pages of memory. A request takes blocks only when it needs them, so many requests fit on one GPU.",
               "With paged attention the KV cache is a pool of fixed-size blocks. Each request has a block table, so memory is not wasted on padding.")),
    "batch": (("What is continuous batching?", "Explain continuous batching.", "How does batching work?",
               "Why is batching fast?"),
              ("Continuous batching adds new requests to the running batch at every step, and removes the ones that finish. The GPU stays busy all the time.",
               "With continuous batching the server does not wait for a whole batch to finish. New requests join at the next step.")),
    "prefix": (("What is prefix caching?", "Explain prefix caching.", "What is a prefix cache?",
                "How does prefix caching work?"),
               ("Prefix caching keeps the KV blocks of prompts that were seen before. When a new prompt starts with the same text, its first blocks are reused and not computed again.",
                "With prefix caching, two requests that share a long system prompt compute it only once.")),
    "prefill": (("What is chunked prefill?", "What is prefill?", "Explain chunked prefill.",
                 "What is the difference between prefill and decode?"),
                ("Prefill reads the whole prompt in one pass, and decode then makes one token at a time. Chunked prefill cuts a long prompt into pieces, so it does not block the other requests.",
                 "During prefill the model reads the prompt. During decode it writes the answer, one token per step.")),
    "token": (("What is a token?", "What are tokens?", "Explain tokens.", "How many tokens is a word?"),
              ("A token is a small piece of text, often a word or part of a word. The model reads and writes tokens, one at a time.",
               "Models see text as tokens. A common word is one token, and a rare word can be several tokens.")),
    "k8s": (("What is Kubernetes?", "How do I deploy pagefleet on Kubernetes?", "What does the operator do?",
             "How does autoscaling work?", "Explain the ModelDeployment resource."),
            ("The pagefleet operator watches ModelDeployment resources and creates a Deployment and a Service for each model.",
             "On Kubernetes, install the operator with Helm and apply a ModelDeployment. The operator scales the replicas with the number of waiting requests.",
             "Kubernetes runs containers on a cluster of machines. The pagefleet operator uses it to deploy models and to scale them when the queue grows.")),
    "gpu": (("Do you run on a GPU?", "Do I need a GPU?", "Why are you so fast?", "Are you running on a CPU?",
             "Can pagefleet use a GPU?"),
            ("This demo runs on a CPU, because it is tiny. A real model needs a GPU, and pagefleet uses Triton kernels and CUDA graphs there.",
             "I am small enough to run on a CPU. For real models, run pagefleet on a GPU.")),
    "openai": (("Can I use the openai client?", "Is the API compatible with OpenAI?", "Which endpoints are there?",
                "How do I call the API?"),
               ("Yes. pagefleet speaks the OpenAI API, so the official openai client works: point its base_url at /v1 on this server.",
                "The server has /v1/chat/completions, /v1/completions and /v1/models, with streaming, plus /health and /metrics.")),
}


def t_concept(rng: random.Random, c: Ctx) -> Turn:
    key = pick(rng, list(CONCEPTS))
    users, answers = CONCEPTS[key]
    return pick(rng, users), pick(rng, answers)


CAPITALS = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Portugal", "Lisbon"), ("Japan", "Tokyo"), ("China", "Beijing"), ("India", "New Delhi"),
    ("Brazil", "Brasília"), ("Canada", "Ottawa"), ("Australia", "Canberra"), ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"), ("Mexico", "Mexico City"), ("Argentina", "Buenos Aires"),
    ("Russia", "Moscow"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"),
    ("Poland", "Warsaw"), ("Greece", "Athens"), ("Turkey", "Ankara"), ("South Korea", "Seoul"),
    ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("Peru", "Lima"), ("Ireland", "Dublin"),
    ("Austria", "Vienna"), ("Belgium", "Brussels"), ("Denmark", "Copenhagen"),
    ("Iceland", "Reykjavík"), ("Colombia", "Bogotá"), ("Cuba", "Havana"), ("Chile", "Santiago"),
    ("New Zealand", "Wellington"), ("Nigeria", "Abuja"),
)


def t_capital(rng: random.Random, c: Ctx) -> Turn:
    country, city = CAPITALS[rng.randrange(len(CAPITALS))]
    user = pick(rng, ("What is the capital of {c}?", "What's the capital of {c}?",
                      "Capital of {c}?", "Which city is the capital of {c}?",
                      "Tell me the capital of {c}.", "Do you know the capital of {c}?")).format(c=country)
    return user, pick(rng, ("The capital of {c} is {x}.", "{x} is the capital of {c}.",
                            "The capital of {c} is {x}. " + pick(rng, (
                                "It is a beautiful city.", "Many people live there.",
                                "Have you ever been there?")))).format(c=country, x=city)


COLORS = (
    ("the sky", "blue", "on a clear day"), ("grass", "green", "in spring"),
    ("snow", "white", "when it is fresh"), ("a banana", "yellow", "when it is ripe"),
    ("a ripe tomato", "red", "in summer"), ("coal", "black", "all the time"),
    ("the sun", "yellow", "in most drawings"), ("a carrot", "orange", "usually"),
    ("the sea", "blue", "on a sunny day"), ("a lemon", "yellow", "when it is ripe"),
    ("milk", "white", "always"), ("a strawberry", "red", "when it is ripe"),
)


def t_color(rng: random.Random, c: Ctx) -> Turn:
    thing, color, when = COLORS[rng.randrange(len(COLORS))]
    user = pick(rng, ("What color is {t}?", "What colour is {t}?", "Which color is {t}?",
                      "Tell me the color of {t}.")).format(t=thing)
    return user, f"{thing[0].upper() + thing[1:]} is {color} {when}."


ANIMALS = (("cat", "meow"), ("dog", "woof"), ("cow", "moo"), ("duck", "quack"),
           ("sheep", "baa"), ("lion", "roar"), ("owl", "hoot"), ("horse", "neigh"),
           ("frog", "ribbit"), ("pig", "oink"), ("mouse", "squeak"), ("bee", "buzz"))


def t_animal(rng: random.Random, c: Ctx) -> Turn:
    animal, sound = ANIMALS[rng.randrange(len(ANIMALS))]
    user = pick(rng, ("What does a {a} say?", "What sound does a {a} make?",
                      "How does a {a} sound?")).format(a=animal)
    art = "An" if animal[0] in "aeiou" else "A"
    return user, pick(rng, (f"{art} {animal} says {sound}.",
                            f"{art} {animal} says \"{sound}\".",
                            f"{art} {animal} makes a sound like {sound}."))


HELLOS = (
    ("French", "Bonjour"), ("Spanish", "¡Hola!"), ("German", "Hallo"), ("Italian", "Ciao"),
    ("Portuguese", "Olá"), ("Japanese", "こんにちは (konnichiwa)"), ("Chinese", "你好 (nǐ hǎo)"),
    ("Russian", "Привет (privet)"), ("Greek", "Γειά σου (yia sou)"), ("Korean", "안녕하세요 (annyeonghaseyo)"),
    ("Turkish", "Merhaba"), ("Hindi", "नमस्ते (namaste)"), ("Swedish", "Hej"), ("Dutch", "Hallo"),
    ("Polish", "Cześć"), ("Czech", "Ahoj"), ("Arabic", "مرحبا (marhaban)"), ("Hebrew", "שלום (shalom)"),
    ("Finnish", "Hei"), ("Vietnamese", "Xin chào"),
)


def t_hello_lang(rng: random.Random, c: Ctx) -> Turn:
    lang, word = HELLOS[rng.randrange(len(HELLOS))]
    user = pick(rng, ("How do you say hello in {l}?", "Say hello in {l}.", "What is hello in {l}?",
                      "How do I greet someone in {l}?", "Hello in {l}?")).format(l=lang)
    return user, pick(rng, ("In {l}, you say {w}.", "In {l} you say {w}. " + pick(rng, (
        "It is a friendly greeting.", "Try it the next time you meet someone.")),
        "{w}! That is hello in {l}.")).format(l=lang, w=word)


def t_languages(rng: random.Random, c: Ctx) -> Turn:
    user = pick(rng, ("Do you speak other languages?", "Can you speak French?", "Parlez-vous français ?",
                      "¿Hablas español?", "Sprichst du Deutsch?", "你会说中文吗？", "日本語を話せますか？"))
    return user, pick(rng, (
        "I mostly speak English, but I know how to say hello in many languages: Bonjour, ¡Hola!, Hallo, こんにちは and 你好.",
        "Only a little. I can say hello in many languages, for example Olá, Ciao, Привет and 안녕하세요, but I answer in English.",
    ))


ANIMAL_HEROES = ("cat", "dog", "fox", "robot", "owl", "rabbit", "dragon", "mouse", "bear", "penguin")
PLACES = ("a quiet village", "a big city", "a green forest", "a small island", "the mountains",
          "an old library", "a busy data center", "a sunny farm")


def t_story(rng: random.Random, c: Ctx) -> Turn:
    hero = pick(rng, ANIMAL_HEROES)
    about = rng.random() < 0.7
    user = pick(rng, ("Tell me a story about a {h}.", "Write a short story about a {h}.",
                      "Can you tell me a story about a {h}?", "A story about a {h}, please.")
                 if about else ("Tell me a story.", "Tell me a short story.", "Write a story.",
                                "Can you tell me a story?", "Tell me a bedtime story."))
    if not about:
        hero = pick(rng, ANIMAL_HEROES)
    user = user.format(h=hero)
    art = "an" if hero[0] in "aeiou" else "a"
    place = pick(rng, PLACES)
    friend = pick(rng, [a for a in ANIMAL_HEROES if a != hero])
    fart = "an" if friend[0] in "aeiou" else "a"
    s1 = pick(rng, (f"Once upon a time, {art} little {hero} lived in {place}.",
                    f"There was once {art} {hero} who lived in {place}.",
                    f"Long ago, in {place}, there lived {art} curious {hero}."))
    s2 = pick(rng, (f"Every morning, the {hero} went for a long walk and looked for something new.",
                    f"The {hero} loved to read books and to watch the stars at night.",
                    f"One day, the {hero} found a small, shiny key under a tree.",
                    f"The {hero} wanted to see the world beyond the hills."))
    s3 = pick(rng, (f"On the way, it met {fart} {friend}, and they became good friends.",
                    f"A kind {friend} showed it the way home.",
                    f"It asked {fart} {friend} for help, and together they solved the puzzle."))
    s4 = pick(rng, ("From that day on, they had many happy adventures together.",
                    "In the end, it learned that the best journeys are the ones we share.",
                    "And when the night came, it went home, tired and happy.",
                    "The end."))
    return user, " ".join((s1, s2, s3, s4))


JOKES = (
    "Why did the GPU go to school? Because it wanted to improve its attention span.",
    "Why do language models never get lost? Because they always follow the next token.",
    "I told the KV cache a secret. Now it keeps bringing it up at every step.",
    "Why was the computer cold? Because it left its Windows open.",
    "What do you call a model that sings? A large language yodel.",
    "Why did the programmer quit his job? Because he did not get arrays.",
)


def t_joke(rng: random.Random, c: Ctx) -> Turn:
    user = pick(rng, ("Tell me a joke.", "Tell me a joke!", "Do you know any jokes?",
                      "Make me laugh.", "Tell me something funny.", "Another joke, please."))
    return user, pick(rng, JOKES)


def t_thanks(rng: random.Random, c: Ctx) -> Turn:
    user = pick(rng, ("Thanks!", "Thank you.", "Thank you very much!", "Thanks a lot.",
                      "Great, thanks!", "That was helpful.", "Cool, thank you.", "Nice!"))
    return user, pick(rng, ("You are welcome!", "You're welcome!", "My pleasure!", "Glad I could help!")) \
        + " " + pick(rng, ("Is there anything else I can do for you?", "Have a nice day.",
                           "Come back any time."))


def t_bye(rng: random.Random, c: Ctx) -> Turn:
    user = pick(rng, ("Bye", "Goodbye!", "See you later.", "Bye bye", "Good night!",
                      "I have to go now.", "See you!"))
    return user, pick(rng, ("Goodbye!", "Bye! Have a great day.", "See you soon!",
                            "Good night, and sleep well.", "Goodbye, and thank you for the chat."))


def t_math(rng: random.Random, c: Ctx) -> Turn:
    a, b = rng.randint(0, 999), rng.randint(1, 999)
    op = pick(rng, ("+", "-", "*", "/", "plus", "times", "minus"))
    user = pick(rng, ("What is {a} {op} {b}?", "Calculate {a} {op} {b}.", "{a} {op} {b} = ?",
                      "Can you do math?", "Solve x + {a} = {b}.", "What is the square root of {b}?")
                ).format(a=a, b=b, op=op)
    return user, pick(rng, (
        "I am too small to do math reliably, so I would rather not guess.",
        "Sorry, I cannot do arithmetic well. I am only a tiny demo model.",
        "Math is hard for a model of my size, and I might give you a wrong number.",
    )) + " " + pick(rng, SERVE_HINT)


# Words for questions the model cannot answer: it should recognise "none of my topics".
_NOUNS = ("love", "time", "music", "the moon", "quantum physics", "history", "money", "football",
          "coffee", "the internet", "a car", "my homework", "the economy", "philosophy", "art",
          "a recipe", "dinner", "my code", "the news", "the stock market", "cooking", "chess",
          "a bug in Python", "the meaning of life", "politics", "medicine", "a poem", "my email",
          "the universe", "climate change", "a holiday", "my garden", "birds", "the ocean",
          "the election", "a song", "black holes", "an essay", "my resume", "gravity")
_VERBS = ("explain", "summarize", "translate", "fix", "write", "describe", "analyze", "compare",
          "improve", "review", "plan", "predict", "draw", "design", "debug")


def t_unknown(rng: random.Random, c: Ctx) -> Turn:
    n, n2, v = pick(rng, _NOUNS), pick(rng, _NOUNS), pick(rng, _VERBS)
    user = pick(rng, ("What do you think about {n}?", "Can you {v} {n}?", "Please {v} {n} for me.",
                      "Tell me about {n}.", "Why is {n} important?", "How does {n} work?",
                      "What is the difference between {n} and {n2}?", "Write {n} about {n2}.",
                      "I need help with {n}.", "Give me advice about {n}.", "Is {n} good or bad?",
                      "What is today's date?", "What time is it?", "Who won the game yesterday?",
                      "Write a Python function that sorts a list.", "Translate this to German: good morning",
                      "Summarize this text for me.", "What is the best way to learn {n}?",
                      "{v} {n}", "Who is the president?", "What should I eat tonight?")
                ).format(n=n, n2=n2, v=v)
    return user, pick(rng, (
        "I am only a tiny demo model, so I do not know much about that.",
        "Sorry, that is beyond what a tiny demo model like me can do.",
        "That is a good question, but I was trained on just a few topics, and this is not one of them.",
        "I cannot help with that, because I am only a small demo model.",
    )) + " " + pick(rng, (
        "I can talk about pagefleet, serving models, capitals and colors, or tell you a story.",
        pick(rng, SERVE_HINT),
        "Ask me what I can do, and I will tell you.",
    ))


# --------------------------------------------------------------------------- tools

WEATHER_TOOL: Tool = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME_TOOL: Tool = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TOOLS = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}

CITIES = tuple(sorted({city for _, city in CAPITALS} | {
    "London", "New York", "San Francisco", "Sydney", "Toronto", "Munich", "Barcelona",
    "Zürich", "Kyoto", "Shanghai", "Mumbai", "Istanbul", "Cape Town", "Chicago", "Seattle",
    "Boston", "Lagos", "Dubai", "Singapore", "Hong Kong", "São Paulo", "Montréal"}))
CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "foggy", "snowy", "clear", "partly cloudy",
              "stormy")


def _weather_question(rng: random.Random, city: str) -> str:
    return pick(rng, ("What is the weather in {c}?", "What's the weather like in {c}?",
                      "How is the weather in {c} today?", "Is it raining in {c}?",
                      "Weather in {c}?", "Do I need an umbrella in {c}?",
                      "How warm is it in {c}?", "Tell me the weather in {c}.")).format(c=city)


def _time_question(rng: random.Random, city: str) -> str:
    return pick(rng, ("What time is it in {c}?", "What's the time in {c}?",
                      "Tell me the time in {c}.", "What is the local time in {c}?",
                      "Time in {c}?")).format(c=city)


def _tool_call(name: str, args: dict) -> Message:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]}


def tool_exchange(rng: random.Random, c: Ctx) -> list[Message]:
    """A weather or time question: a call when the request offers the tool (then the
    tool's answer and a sentence from it), a polite refusal when it does not."""
    city = pick(rng, CITIES)
    want = pick(rng, ("get_weather", "get_time"))
    question = _weather_question(rng, city) if want == "get_weather" else _time_question(rng, city)
    msgs: list[Message] = [{"role": "user", "content": _user_noise(rng, question)}]
    if want not in c.tools:
        what = "the weather" if want == "get_weather" else "the time"
        if c.tools:
            reply = pick(rng, (f"I cannot check {what}: none of the tools I was given can do that.",
                               f"Sorry, the tools in this request cannot tell {what}."))
        else:
            reply = pick(rng, (f"I cannot check {what}, because no tools were given to me.",
                               f"I have no live data, so I cannot tell you {what} in {city}.")) \
                + " " + pick(rng, (f"Pass a {want} tool in the request, and I will call it.",
                                   f"Give me a {want} tool, and I can look it up."))
        msgs.append({"role": "assistant", "content": reply})
        return msgs
    msgs.append(_tool_call(want, {"city": city}))
    if rng.random() < 0.15:
        return msgs            # a dialogue may end at the call, as a client sees it
    if want == "get_weather":
        temp = rng.randint(-15, 38)
        cond = pick(rng, CONDITIONS)
        unit = "°C" if rng.random() < 0.8 else "°F"
        if unit == "°F":
            temp = round(temp * 9 / 5 + 32)
        result = {"city": city, "temperature": temp, "unit": unit, "condition": cond}
        answer = pick(rng, ("It is {t} {u} and {w} in {c} right now.",
                            "The weather in {c} is {w}, with a temperature of {t} {u}.",
                            "Right now it is {w} in {c}, and the temperature is {t} {u}.")
                      ).format(t=temp, u=unit, w=cond, c=city)
        if cond in ("rainy", "stormy") and rng.random() < 0.6:
            answer += " Take an umbrella!"
    else:
        hh, mm = rng.randint(0, 23), rng.randint(0, 59)
        result = {"city": city, "time": f"{hh:02d}:{mm:02d}"}
        answer = pick(rng, ("It is {h:02d}:{m:02d} in {c} right now.",
                            "The local time in {c} is {h:02d}:{m:02d}.")).format(h=hh, m=mm, c=city)
    msgs.append({"role": "tool", "content": json.dumps(result, ensure_ascii=False)})
    msgs.append({"role": "assistant", "content": answer})
    return msgs


# --------------------------------------------------------------------------- mixing

# (topic, weight, generator). Weights favour what a first user types.
TOPICS: tuple[tuple[str, float, TopicFn], ...] = (
    ("greeting", 8, t_greeting),
    ("identity", 8, t_identity),
    ("name", 3, t_name),
    ("how_are_you", 3, t_how_are_you),
    ("capabilities", 4, t_capabilities),
    ("pagefleet", 4, t_pagefleet),
    ("serve_real", 4, t_serve_real),
    ("concept", 9, t_concept),
    ("capital", 7, t_capital),
    ("color", 3, t_color),
    ("animal", 3, t_animal),
    ("hello_lang", 5, t_hello_lang),
    ("languages", 2, t_languages),
    ("story", 7, t_story),
    ("joke", 3, t_joke),
    ("thanks", 3, t_thanks),
    ("bye", 2, t_bye),
    ("math", 3, t_math),
    ("unknown", 10, t_unknown),
)
TOOL_WEIGHT = 6      # dialogues that are a weather/time exchange


def _context(rng: random.Random) -> tuple[Ctx, list[Message]]:
    r = rng.random()
    if r < 0.72:
        return Ctx(), []
    if r < 0.9:
        return Ctx(), [{"role": "system", "content": pick(rng, SYSTEM_PROMPTS)}]
    name = pick(rng, NAMES)
    return Ctx(name=name, named=True), [
        {"role": "system", "content": pick(rng, NAMED_SYSTEM_PROMPTS).format(name=name)}]


def _tool_set(rng: random.Random) -> tuple[str, ...]:
    return pick(rng, (("get_weather",), ("get_time",), ("get_weather", "get_time"),
                      ("get_time", "get_weather")))


def dialogue(rng: random.Random) -> Dialogue:
    """One dialogue: optional system prompt, optional tools, 1-3 exchanges."""
    c, msgs = _context(rng)
    tools: list[Tool] | None = None
    tool_dialogue = rng.random() < TOOL_WEIGHT / (TOOL_WEIGHT + sum(w for _, w, _ in TOPICS))
    if tool_dialogue or rng.random() < 0.02:
        # Requests with tools: mostly tool questions, sometimes plain chat (no call).
        if tool_dialogue and rng.random() < 0.2:
            c.tools = ()
        else:
            c.tools = _tool_set(rng)
            tools = [TOOLS[n] for n in c.tools]
    names = [t for t, _, _ in TOPICS]
    weights = [w for _, w, _ in TOPICS]
    fns = {t: f for t, _, f in TOPICS}
    n_turns = 1 if rng.random() < 0.8 else rng.choice((2, 3))
    topic = "tools" if tool_dialogue else ""
    for i in range(n_turns):
        last = i == n_turns - 1
        if last and tool_dialogue:
            msgs.extend(tool_exchange(rng, c))
            break
        t = rng.choices(names, weights)[0]
        user, answer = fns[t](rng, c)
        msgs.append({"role": "user", "content": _user_noise(rng, user)})
        msgs.append({"role": "assistant", "content": answer})
        topic = topic or t
        if last:
            topic = t
    return Dialogue(messages=msgs, tools=tools, topic=topic)


def dialogues(seed: int) -> Iterator[Dialogue]:
    """An endless, seeded stream of dialogues (the same seed, the same stream)."""
    rng = random.Random(seed)
    while True:
        yield dialogue(rng)


def sample_text(seed: int, n: int, render: Callable[[Dialogue], str]) -> list[str]:
    """n dialogues rendered as training text (chat template included), for the BPE."""
    it = dialogues(seed)
    return [render(next(it)) for _ in range(n)]
