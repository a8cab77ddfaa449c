"""What the wide synthetic worlds are made of: entity kinds, relations, and the phrasings of facts
and questions (``worlds.py`` builds worlds from them).

A relation links a subject kind to an object: another entity kind (a link, which chains compose)
or a value (``year``, ``number``, ``amount``, ``role``, ``currency``: an attribute). Each relation
names its fact three ways, from which every phrasing is built:

    pred   the predicate after the subject        "was born in {o}"
    noun   what the object is to the subject      "birthplace"
    inv    a clause that starts with the object   "{o} is the city where {s} was born"
    wh     a question about it ({x}: the subject) "Where was {x} born?"

Fact phrasings (``FACT_FRAMES``) and question phrasings (``QUESTION_FRAMES``) are written over
those forms, so each fact has every frame's wording and each question pattern every question
frame's; a share of both is held out of training (``HELD_OUT_*``) to measure unseen phrasings.
"""

from __future__ import annotations

from dataclasses import dataclass

ENTITY_KINDS = ("person", "company", "product", "city", "country", "project", "work", "event", "institution")
VALUE_KINDS = ("year", "number", "amount", "role", "currency")


@dataclass(frozen=True, slots=True)
class Relation:
    name: str
    subject: str
    object: str
    pred: str
    noun: str
    inv: str
    wh: str

    @property
    def is_link(self) -> bool:
        return self.object in ENTITY_KINDS


def capitalised(text: str) -> str:
    """``text`` with its first letter upper-case (a sentence that opens with a value or name)."""
    return text[:1].upper() + text[1:]


def doc_id(kind: str, name: str) -> str:
    return f"{kind}:{name.lower().replace(' ', '-')}"


R = Relation
RELATIONS = (
    # person
    R("birthplace", "person", "city", "was born in {o}", "birthplace", "{o} is the city where {s} was born",
      "Where was {x} born?"),
    R("employer", "person", "company", "works for {o}", "employer", "{o} is the company {s} works for",
      "Which company does {x} work for?"),
    R("alma_mater", "person", "institution", "studied at {o}", "alma mater", "{o} is where {s} studied",
      "Where did {x} study?"),
    R("birth_year", "person", "year", "was born in the year {o}", "birth year", "{o} is the year {s} was born",
      "In which year was {x} born?"),
    R("job_title", "person", "role", "holds the title of {o}", "job title", "{o} is the title {s} holds",
      "What title does {x} hold?"),
    R("mentor", "person", "person", "was mentored by {o}", "mentor", "{o} is the person who mentored {s}",
      "Who mentored {x}?"),
    # company
    R("founder", "company", "person", "was founded by {o}", "founder", "{o} is the person who founded {s}",
      "Who founded {x}?"),
    R("headquarters", "company", "city", "is headquartered in {o}", "headquarters city",
      "{o} is the city where {s} has its headquarters", "Where is {x} headquartered?"),
    R("founding_year", "company", "year", "was founded in the year {o}", "founding year",
      "{o} is the year {s} was founded", "In which year was {x} founded?"),
    R("chief_executive", "company", "person", "is run by chief executive {o}", "chief executive",
      "{o} is the chief executive of {s}", "Who runs {x}?"),
    R("staff", "company", "number", "employs {o} people", "number of employees", "{o} people work at {s}",
      "How many people does {x} employ?"),
    R("parent_company", "company", "company", "is a subsidiary of {o}", "parent company",
      "{o} is the company that owns {s}", "Which company owns {x}?"),
    R("revenue", "company", "amount", "reported annual revenue of {o}", "annual revenue",
      "{o} is the annual revenue {s} reported", "How much revenue did {x} report?"),
    # product
    R("maker", "product", "company", "is made by {o}", "maker", "{o} is the company that makes {s}",
      "Which company makes {x}?"),
    R("release_year", "product", "year", "was released in the year {o}", "release year",
      "{o} is the year {s} came out", "When was {x} released?"),
    R("designer", "product", "person", "was designed by {o}", "designer", "{o} is the person who designed {s}",
      "Who designed {x}?"),
    R("price", "product", "amount", "sells for {o}", "price", "{o} is what {s} sells for", "How much does {x} cost?"),
    R("assembly_city", "product", "city", "is assembled in {o}", "assembly city",
      "{o} is the city where {s} is assembled", "Where is {x} assembled?"),
    # city
    R("country", "city", "country", "lies in {o}", "country", "{o} is the country {s} lies in",
      "Which country is {x} in?"),
    R("population", "city", "number", "has a population of {o}", "population", "{o} people live in {s}",
      "How many people live in {x}?"),
    R("mayor", "city", "person", "is governed by mayor {o}", "mayor", "{o} is the mayor of {s}",
      "Who is the mayor of {x}?"),
    # country
    R("capital", "country", "city", "has its capital at {o}", "capital", "{o} is the capital of {s}",
      "What is the capital of {x}?"),
    R("currency", "country", "currency", "pays in {o}", "currency", "{o} is the money used in {s}",
      "What currency does {x} use?"),
    # project
    R("leader", "project", "person", "is led by {o}", "leader", "{o} is the person who leads {s}", "Who leads {x}?"),
    R("sponsor", "project", "company", "is funded by {o}", "sponsor", "{o} is the company that funds {s}",
      "Who funds {x}?"),
    R("budget", "project", "amount", "has a budget of {o}", "budget", "{o} is the budget of {s}",
      "What is the budget of {x}?"),
    R("base_city", "project", "city", "is based in {o}", "base city", "{o} is the city where {s} is based",
      "Where is {x} based?"),
    R("start_year", "project", "year", "started in the year {o}", "start year", "{o} is the year {s} started",
      "When did {x} start?"),
    # work
    R("author", "work", "person", "was written by {o}", "author", "{o} is the person who wrote {s}",
      "Who wrote {x}?"),
    R("publisher", "work", "company", "was published by {o}", "publisher", "{o} is the company that published {s}",
      "Who published {x}?"),
    R("publication_year", "work", "year", "was published in the year {o}", "publication year",
      "{o} is the year {s} appeared", "When was {x} published?"),
    R("setting", "work", "city", "is set in {o}", "setting", "{o} is the city where {s} takes place",
      "Where is {x} set?"),
    R("pages", "work", "number", "runs to {o} pages", "page count", "{o} pages make up {s}",
      "How many pages does {x} have?"),
    # event
    R("venue_city", "event", "city", "takes place in {o}", "host city", "{o} is the city that hosts {s}",
      "Where does {x} take place?"),
    R("organizer", "event", "institution", "is organised by {o}", "organiser", "{o} is the body that organises {s}",
      "Who organises {x}?"),
    R("first_year", "event", "year", "was first held in the year {o}", "first year",
      "{o} is the year {s} was first held", "When was {x} first held?"),
    R("attendance", "event", "number", "draws {o} visitors", "attendance", "{o} visitors come to {s}",
      "How many visitors does {x} draw?"),
    # institution
    R("campus_city", "institution", "city", "has its campus in {o}", "campus city",
      "{o} is the city where {s} has its campus", "Where is the campus of {x}?"),
    R("president", "institution", "person", "is presided over by {o}", "president", "{o} is the president of {s}",
      "Who is the president of {x}?"),
    R("established", "institution", "year", "was established in the year {o}", "year of establishment",
      "{o} is the year {s} was established", "When was {x} established?"),
)
RELATION = {r.name: r for r in RELATIONS}

HELD_OUT_RELATIONS = ("mentor", "designer", "mayor", "sponsor", "setting", "organizer", "staff", "start_year")
"""Relations no training world has: the unseen-relation splits' chains each use one of them."""

# Fact phrasings. {s} subject, {o} object, {pred} {noun} {inv} the relation's forms; {other} and
# {other_o}: another entity of the subject's kind and its own object for the relation (a
# distracting name and value); a second fact of the same subject: {pred2} {noun2} {o2}.
FACT_FRAMES = {
    "plain": "{s} {pred}.",
    "noun_of": "The {noun} of {s} is {o}.",
    "object_first": "{o} is the {noun} of {s}.",
    "records": "According to public records, {s} {pred}.",
    "unlike": "Unlike {other}, which {other_pred}, {s} {pred}.",
    "two_facts": "{s} {pred}, and it {pred2}.",
    "possessive": "{s}'s {noun} is {o}.",
    "inverse": "{inv_cap}.",
    "whose": "{s}, whose {noun} is {o}, {pred2}.",
    "cleft": "It is {o} that is the {noun} of {s}.",
}
HELD_OUT_FACT_FRAMES = ("possessive", "inverse", "whose", "cleft")

# More phrasings for training worlds only (``rig synth --generator wide --extra-phrasings``): a
# reader taught on six frames learns those six sentences; more ways of stating a fact teach reading
# (none is a held-out frame or shares its wording: no "It is", "whose" or "'s").
EXTRA_FACT_FRAMES = {
    "serves_as": "{o} serves as the {noun} of {s}.",
    "as_for": "As for {s}, its {noun} is {o}.",
    "listed": "Records list {o} as the {noun} of {s}.",
    "dash": "{s} - {noun}: {o}.",
    "has_as": "{s} has {o} as {noun}.",
    "would_be": "The {noun} of {s}? That would be {o}.",
}

# Question phrasings over a noun phrase {np} ("the founder of Korath Labs") and the last relation.
QUESTION_FRAMES = {
    "what_is": "What is the {noun} of {np}?",
    "tell_me": "Tell me the {noun} of {np}.",
    "like_to_know": "I'd like to know the {noun} of {np}.",
    "which_kind": "Which {kind} is the {noun} of {np}?",
    "wh": "{wh}",
    "do_you_know": "Do you know the {noun} of {np}?",
    "possessive": "What is {np_poss} {noun}?",
    "find_out": "Can you find out the {noun} of {np}?",
    "need": "I need the {noun} of {np}, please.",
}
HELD_OUT_QUESTION_FRAMES = ("do_you_know", "possessive", "find_out", "need")
EXTRA_QUESTION_FRAMES = {
    "whats": "What's the {noun} of {np}?",
    "name_the": "Name the {noun} of {np}.",
    "looking_for": "I'm looking for the {noun} of {np}.",
    "please_tell": "Please tell me the {noun} of {np}.",
    "who_or_what_is": "Who or what is the {noun} of {np}?",
    "question_last": "The {noun} of {np} is what?",
}
"""Question phrasings for training worlds only, like ``EXTRA_FACT_FRAMES``."""
EVERY_FACT_FRAME = FACT_FRAMES | EXTRA_FACT_FRAMES
EVERY_QUESTION_FRAME = QUESTION_FRAMES | EXTRA_QUESTION_FRAMES
"""Each phrasing's template by name, the benchmark's and the training-only ones."""

KIND_WORD = {"person": "person", "company": "company", "product": "product", "city": "city", "country": "country",
             "project": "project", "work": "book", "event": "event", "institution": "institution",
             "year": "year", "number": "number", "amount": "amount", "role": "title", "currency": "currency"}

INTRO = {
    "person": ["{e} is an engineer.", "{e} is a researcher.", "{e} is a businessperson.", "{e} is a writer."],
    "company": ["{e} is a company.", "{e} is a manufacturing firm.", "{e} is a technology business."],
    "product": ["{e} is a product.", "{e} is a consumer device.", "{e} is an appliance."],
    "city": ["{e} is a city.", "{e} is a town.", "{e} is a port city."],
    "country": ["{e} is a country.", "{e} is a small nation."],
    "project": ["{e} is a research project.", "{e} is an engineering programme."],
    "work": ["{e} is a novel.", "{e} is a book.", "{e} is a travel memoir."],
    "event": ["{e} is an annual festival.", "{e} is a trade fair.", "{e} is a conference."],
    "institution": ["{e} is a university.", "{e} is a technical institute."],
}

ROLES = ("chief engineer", "head of research", "lead designer", "chief financial officer", "product manager",
         "principal scientist", "operations director", "head of sales", "chief architect", "legal counsel")

# Questions that need no search, in three disjoint lists: one per kind of split.
COMMON = {
    "train": [("What is the capital of France?", "Paris"), ("How many days are in a week?", "seven"),
              ("What color do you get by mixing blue and yellow?", "green"), ("How many legs does a spider have?",
                                                                               "eight"),
              ("What is the largest planet in the solar system?", "Jupiter"), ("Who wrote Romeo and Juliet?",
                                                                               "Shakespeare"),
              ("How many minutes are in an hour?", "sixty"), ("What is the chemical symbol for gold?", "Au"),
              ("What is the freezing point of water in degrees Celsius?", "0"),
              ("How many sides does a triangle have?", "three"), ("What is the opposite of hot?", "cold"),
              ("Which animal is known as the king of the jungle?", "lion")],
    "dev": [("How many months are in a year?", "twelve"), ("What is the capital of Italy?", "Rome"),
            ("What color is the sky on a clear day?", "blue"), ("How many hours are in a day?", "24")],
    "test": [("What is the capital of Japan?", "Tokyo"), ("How many continents are there?", "seven"),
             ("What gas do plants absorb from the air?", "carbon dioxide"), ("How many sides does a square have?",
                                                                             "four"),
             ("Which ocean lies between Europe and North America?", "Atlantic"),
             ("What is the boiling point of water in degrees Celsius at sea level?", "100"),
             ("What is the opposite of up?", "down"), ("How many wheels does a bicycle have?", "two")],
}
# More questions that need no search, for the train world only (rig synth --extra-no-search): twelve
# are too few to teach "general knowledge needs no search" rather than "these twelve need none".
# Disjoint from the dev and test lists (tests/test_worlds.py).
EXTRA_COMMON = [
    ("What is the capital of Germany?", "Berlin"), ("What is the capital of Spain?", "Madrid"),
    ("What is the capital of Canada?", "Ottawa"), ("What is the capital of Egypt?", "Cairo"),
    ("What is the capital of Russia?", "Moscow"), ("What is the capital of China?", "Beijing"),
    ("What is the capital of the United Kingdom?", "London"), ("What is the capital of Greece?", "Athens"),
    ("What is the capital of Portugal?", "Lisbon"), ("What is the capital of Ireland?", "Dublin"),
    ("What is the capital of Austria?", "Vienna"), ("What is the capital of Norway?", "Oslo"),
    ("What is the capital of Kenya?", "Nairobi"), ("What is the capital of Argentina?", "Buenos Aires"),
    ("How many days are in a leap year?", "366"), ("How many seconds are in a minute?", "sixty"),
    ("How many weeks are in a year?", "52"), ("How many days does September have?", "30"),
    ("How many legs does an insect have?", "six"), ("How many legs does a dog have?", "four"),
    ("How many eyes does a person have?", "two"), ("How many fingers are on one hand?", "five"),
    ("How many sides does a hexagon have?", "six"), ("How many sides does a pentagon have?", "five"),
    ("How many sides does an octagon have?", "eight"), ("How many planets orbit the Sun?", "eight"),
    ("How many players are on a soccer team on the field?", "eleven"), ("How many strings does a violin have?", "four"),
    ("How many letters are in the English alphabet?", "26"), ("How many zeros are in one thousand?", "three"),
    ("What color are ripe bananas?", "yellow"), ("What color is grass?", "green"),
    ("What color do you get by mixing red and white?", "pink"), ("What color do you get by mixing red and blue?", "purple"),
    ("What color is snow?", "white"), ("What color is a ripe tomato?", "red"),
    ("What is the largest ocean on Earth?", "Pacific"), ("What is the tallest mountain on Earth?", "Mount Everest"),
    ("What is the longest river in Africa?", "Nile"), ("What is the largest desert in Africa?", "Sahara"),
    ("Which planet is known as the Red Planet?", "Mars"), ("Which planet is closest to the Sun?", "Mercury"),
    ("What is the closest star to Earth?", "the Sun"), ("What does the Moon orbit?", "Earth"),
    ("What is the chemical symbol for water?", "H2O"), ("What is the chemical symbol for iron?", "Fe"),
    ("What is the chemical symbol for oxygen?", "O"), ("What gas do humans breathe in to live?", "oxygen"),
    ("What is frozen water called?", "ice"), ("What is the hardest natural substance?", "diamond"),
    ("What force pulls objects toward the Earth?", "gravity"), ("What do bees make?", "honey"),
    ("What do caterpillars turn into?", "butterflies"), ("What is a baby cat called?", "kitten"),
    ("What is a baby dog called?", "puppy"), ("What is a baby cow called?", "calf"),
    ("Which animal is the largest mammal?", "blue whale"), ("Which bird is a symbol of peace?", "dove"),
    ("What is the fastest land animal?", "cheetah"), ("Which animal has a trunk?", "elephant"),
    ("What do cows drink?", "water"), ("What do pandas mainly eat?", "bamboo"),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci"), ("Who wrote Hamlet?", "Shakespeare"),
    ("Who developed the theory of relativity?", "Albert Einstein"), ("Who was the first person to walk on the Moon?", "Neil Armstrong"),
    ("Who invented the telephone?", "Alexander Graham Bell"), ("Who wrote Pride and Prejudice?", "Jane Austen"),
    ("What is the opposite of cold?", "hot"), ("What is the opposite of big?", "small"),
    ("What is the opposite of fast?", "slow"), ("What is the opposite of light?", "dark"),
    ("What is the opposite of left?", "right"), ("What is the opposite of old?", "new"),
    ("What is the plural of mouse?", "mice"), ("What is the plural of child?", "children"),
    ("What is the past tense of go?", "went"), ("What is the past tense of eat?", "ate"),
    ("What language is spoken in Brazil?", "Portuguese"), ("What language is spoken in Mexico?", "Spanish"),
    ("What currency is used in Japan?", "yen"), ("What currency is used in the United States?", "dollar"),
    ("What is the square root of 81?", "9"), ("What is the square root of 49?", "7"),
    ("What is half of 50?", "25"), ("What is ten squared?", "100"),
    ("How many degrees are in a right angle?", "90"), ("How many degrees are in a full circle?", "360"),
    ("What is the first month of the year?", "January"), ("What is the last month of the year?", "December"),
    ("Which day comes after Monday?", "Tuesday"), ("Which day comes before Sunday?", "Saturday"),
    ("In which season do leaves fall from trees?", "autumn"), ("What is the coldest season?", "winter"),
    ("What organ pumps blood through the body?", "the heart"), ("What organ do humans think with?", "the brain"),
    ("How many bones are in the adult human body?", "206"), ("How many teeth does an adult human usually have?", "32"),
    ("What shape has three sides?", "triangle"), ("What shape is a ball?", "sphere"),
    ("What instrument has black and white keys?", "piano"), ("What sport uses a bat and a ball and has wickets?", "cricket"),
    ("Which metal is liquid at room temperature?", "mercury"), ("What is the main ingredient of bread?", "flour"),
]
ARITHMETIC = {"train": ("What is {a} plus {b}?", lambda a, b: a + b),
              "dev": ("What is {a} minus {b}?", lambda a, b: a - b),
              "test": ("What is {a} times {b}?", lambda a, b: a * b)}
