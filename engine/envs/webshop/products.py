"""The product types of the generated WebShop catalogue (data.py): the original's five categories,
8 types each, with each type's attribute pool, option pools and price range (a data table, no logic)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PRODUCT_TYPES", "ProductType"]

# ------------------------------------------------------------------------------------------ vocabulary

COLORS = [
    "black", "white", "navy", "red", "olive", "khaki", "burgundy", "pink", "beige", "charcoal", "teal",
    "mustard", "lavender", "coral", "brown", "silver",
]  # fmt: skip
CLOTH_SIZES = ["x-small", "small", "medium", "large", "x-large", "xx-large", "3x-large"]
SHOE_SIZES = ["6", "6.5", "7", "7.5", "8", "8.5", "9", "9.5", "10", "10.5", "11", "12"]
WAIST_SIZES = ["28w x 30l", "30w x 30l", "30w x 32l", "32w x 32l", "34w x 32l", "36w x 34l", "38w x 34l"]
PACKS = ["pack of 1", "pack of 2", "pack of 3", "pack of 6", "pack of 12"]
COUNTS = ["20 count", "40 count", "60 count", "100 count"]
OUNCES = ["8 ounce", "12 ounce", "16 ounce", "1.5 pound", "2 pound", "32 ounce"]
FLUID = ["8.4 fl oz", "12 fl oz", "16.9 fl oz", "33.8 fl oz"]


@dataclass(frozen=True)
class ProductType:
    name: str  # the type phrase used in titles and instructions ("t-shirt")
    audience: str  # "men's", "women's" or ""
    query: str  # the search query the product was "scraped" under (type match)
    path: str  # product_category, "A › B › C"
    attributes: tuple[str, ...]
    options: dict[str, tuple[str, ...]] = field(default_factory=dict)
    price: tuple[float, float] = (10.0, 60.0)


def _t(name, audience, query, path, attrs, options, price):  # noqa: ANN001, ANN202 - table helper
    return ProductType(name, audience, query, path, tuple(attrs), {k: tuple(v) for k, v in options.items()}, price)


_FASHION = "Clothing, Shoes & Jewelry"
_FOOD = "Grocery & Gourmet Food"
_BEAUTY = "Beauty & Personal Care"
_ELEC = "Electronics"
_HOME = "Home & Kitchen"

PRODUCT_TYPES: dict[str, list[ProductType]] = {
    "fashion": [
        _t("t-shirt", "men's", "men's t-shirts", f"{_FASHION} › Men › Clothing › Shirts › T-Shirts",
           ["machine washable", "short sleeve", "cotton", "slim fit", "moisture wicking", "crew neck", "tagless"],
           {"color": COLORS, "size": CLOTH_SIZES}, (8, 35)),
        _t("dress", "women's", "women's dresses", f"{_FASHION} › Women › Clothing › Dresses",
           ["long sleeve", "v-neck", "polyester", "elastic waist", "midi length", "floral print", "hand wash"],
           {"color": COLORS, "size": CLOTH_SIZES}, (18, 70)),
        _t("jeans", "men's", "men's jeans", f"{_FASHION} › Men › Clothing › Jeans",
           ["straight leg", "stretch", "relaxed fit", "button closure", "denim", "machine wash", "five pocket"],
           {"color": ["light wash", "dark wash", "black", "stonewash", "indigo", "grey"], "size": WAIST_SIZES},
           (20, 80)),
        _t("hoodie", "women's", "women's hoodies", f"{_FASHION} › Women › Clothing › Fashion Hoodies",
           ["fleece lined", "drawstring", "kangaroo pocket", "oversized", "pullover", "zip up", "soft fabric"],
           {"color": COLORS, "size": CLOTH_SIZES}, (15, 55)),
        _t("running shoes", "men's", "men's running shoes", f"{_FASHION} › Men › Shoes › Athletic › Running",
           ["rubber sole", "lace up", "non slip", "breathable mesh", "lightweight", "memory foam", "arch support"],
           {"color": COLORS, "size": SHOE_SIZES}, (30, 120)),
        _t("sandals", "women's", "women's sandals", f"{_FASHION} › Women › Shoes › Sandals",
           ["open toe", "ankle strap", "cushioned footbed", "flat", "faux leather", "adjustable buckle", "wedge"],
           {"color": COLORS, "size": SHOE_SIZES}, (15, 60)),
        _t("socks", "", "athletic socks", f"{_FASHION} › Men › Clothing › Socks & Hosiery › Athletic Socks",
           ["cushioned", "ankle length", "anti blister", "quick dry", "arch compression", "cotton blend"],
           {"color": COLORS, "size": ["small", "medium", "large"], "style": PACKS}, (8, 30)),
        _t("rain jacket", "women's", "women's rain jackets", f"{_FASHION} › Women › Clothing › Coats & Jackets",
           ["waterproof", "hooded", "packable", "windproof", "zipper pockets", "lightweight shell", "sealed seams"],
           {"color": COLORS, "size": CLOTH_SIZES}, (25, 110)),
    ],
    "food": [
        _t("green tea", "", "green tea bags", f"{_FOOD} › Beverages › Tea › Green",
           ["organic", "gluten free", "non gmo", "individually wrapped", "kosher", "caffeine free", "fair trade"],
           {"flavor name": ["jasmine", "mint", "lemon", "honey ginger", "original", "matcha"], "size": COUNTS},
           (5, 25)),
        _t("coffee beans", "", "whole bean coffee", f"{_FOOD} › Beverages › Coffee › Whole Coffee Beans",
           ["dark roast", "medium roast", "single origin", "arabica", "organic", "fair trade", "low acid"],
           {"flavor name": ["colombian", "french roast", "hazelnut", "vanilla", "espresso", "breakfast blend"],
            "size": OUNCES}, (9, 45)),
        _t("protein bars", "", "protein bars", f"{_FOOD} › Snack Foods › Bars › Protein Bars",
           ["high protein", "low sugar", "gluten free", "keto friendly", "plant based", "soy free", "non gmo"],
           {"flavor name": ["chocolate chip", "peanut butter", "cookie dough", "birthday cake", "almond", "lemon"],
            "size": ["12 count", "15 count", "18 count", "24 count"]}, (12, 40)),
        _t("beef jerky", "", "beef jerky", f"{_FOOD} › Meat & Seafood › Jerky & Dried Meats",
           ["high protein", "low fat", "gluten free", "no preservatives", "grass fed", "resealable bag"],
           {"flavor name": ["original", "teriyaki", "peppered", "sweet and spicy", "hickory smoked"],
            "size": ["2.5 ounce", "3.25 ounce", "8 ounce", "10 ounce"]}, (6, 35)),
        _t("gummy candy", "", "gummy candy", f"{_FOOD} › Snack Foods › Candy & Chocolate › Gummy Candy",
           ["fat free", "vegan", "gelatin free", "individually wrapped", "kosher", "natural flavors"],
           {"flavor name": ["sour", "cherry", "tropical", "watermelon", "assorted fruit", "peach"], "size": PACKS},
           (4, 25)),
        _t("olive oil", "", "extra virgin olive oil", f"{_FOOD} › Pantry Staples › Cooking Oils › Olive",
           ["extra virgin", "cold pressed", "first harvest", "organic", "non gmo", "glass bottle"],
           {"size": FLUID, "style": ["single bottle", "pack of 2", "tin can"]}, (8, 45)),
        _t("pasta sauce", "", "pasta sauce jar", f"{_FOOD} › Pantry Staples › Sauces › Pasta Sauces",
           ["no sugar added", "vegan", "low sodium", "gluten free", "slow cooked", "imported"],
           {"flavor name": ["marinara", "tomato basil", "arrabbiata", "vodka", "roasted garlic"],
            "size": ["24 ounce", "25 ounce", "32 ounce"]}, (4, 20)),
        _t("trail mix", "", "trail mix snack", f"{_FOOD} › Snack Foods › Trail Mix",
           ["resealable bag", "no artificial colors", "high fiber", "gluten free", "kosher", "roasted nuts"],
           {"flavor name": ["mountain mix", "sweet and salty", "tropical", "dark chocolate", "cranberry almond"],
            "size": OUNCES}, (6, 30)),
    ],
    "beauty": [
        _t("shampoo", "", "sulfate free shampoo", f"{_BEAUTY} › Hair Care › Shampoo & Conditioner › Shampoos",
           ["sulfate free", "paraben free", "color safe", "cruelty free", "argan oil", "for dry hair", "vegan"],
           {"size": FLUID, "scent": ["coconut", "lavender", "tea tree", "unscented", "citrus", "rosemary mint"]},
           (6, 35)),
        _t("face moisturizer", "", "face moisturizer", f"{_BEAUTY} › Skin Care › Face › Moisturizers",
           ["hyaluronic acid", "oil free", "spf 30", "fragrance free", "for sensitive skin", "non comedogenic"],
           {"size": ["1 fl oz", "1.7 fl oz", "2.5 fl oz", "3.4 fl oz"]}, (9, 60)),
        _t("lipstick", "", "matte lipstick", f"{_BEAUTY} › Makeup › Lips › Lipstick",
           ["long lasting", "matte finish", "cruelty free", "moisturizing", "waterproof", "paraben free"],
           {"color": ["ruby red", "nude", "berry", "coral", "mauve", "plum", "rose"]}, (5, 30)),
        _t("nail polish", "", "nail polish", f"{_BEAUTY} › Foot, Hand & Nail Care › Nail Polish",
           ["quick dry", "chip resistant", "non toxic", "gel finish", "vegan", "high shine"],
           {"color": COLORS, "size": ["0.5 fl oz", "pack of 2", "pack of 6"]}, (4, 22)),
        _t("hair dryer", "", "ionic hair dryer", f"{_BEAUTY} › Hair Care › Styling Tools › Hair Dryers",
           ["ionic", "ceramic", "diffuser included", "cool shot button", "lightweight", "foldable handle"],
           {"color": ["black", "white", "pink", "rose gold", "purple"], "style": ["1875 watt", "1600 watt"]},
           (20, 90)),
        _t("deodorant", "", "natural deodorant", f"{_BEAUTY} › Personal Care › Deodorants & Antiperspirants",
           ["aluminum free", "baking soda free", "long lasting", "travel size", "vegan", "for sensitive skin"],
           {"scent": ["lavender", "cedarwood", "citrus", "unscented", "eucalyptus", "vanilla"], "size": PACKS},
           (5, 25)),
        _t("body wash", "", "moisturizing body wash", f"{_BEAUTY} › Personal Care › Body › Body Washes",
           ["moisturizing", "sulfate free", "natural ingredients", "dermatologist tested", "shea butter"],
           {"scent": ["coconut", "lavender", "oatmeal", "cucumber", "unscented", "citrus"], "size": FLUID},
           (5, 25)),
        _t("eyeshadow palette", "", "eyeshadow palette", f"{_BEAUTY} › Makeup › Eyes › Eyeshadow",
           ["highly pigmented", "long lasting", "cruelty free", "blendable", "shimmer and matte", "travel size"],
           {"color": ["nude", "smoky", "sunset", "rose gold", "neutral", "jewel tones"]}, (8, 45)),
    ],
    "electronics": [
        _t("wireless earbuds", "", "wireless earbuds", f"{_ELEC} › Headphones, Earbuds & Accessories › Earbuds",
           ["noise cancelling", "bluetooth 5.3", "water resistant", "charging case", "touch control", "deep bass"],
           {"color": ["black", "white", "navy", "pink", "silver"]}, (20, 150)),
        _t("phone case", "", "iphone case", f"{_ELEC} › Cell Phones & Accessories › Cases, Holsters & Sleeves",
           ["shockproof", "slim", "clear back", "wireless charging compatible", "kickstand", "raised edges"],
           {"color": COLORS, "size": ["iphone 13", "iphone 14", "iphone 15", "iphone 15 pro", "iphone 15 plus"]},
           (8, 35)),
        _t("usb c cable", "", "usb c charging cable", f"{_ELEC} › Computers & Accessories › Cables › USB Cables",
           ["fast charging", "braided nylon", "data transfer", "durable", "tangle free", "usb 3.1"],
           {"size": ["3 ft", "6 ft", "10 ft"], "style": PACKS}, (6, 25)),
        _t("bluetooth speaker", "", "portable bluetooth speaker", f"{_ELEC} › Portable Audio & Video › Speakers",
           ["waterproof", "portable", "long battery life", "stereo pairing", "built in microphone", "rugged"],
           {"color": ["black", "navy", "red", "teal", "grey", "camo"]}, (20, 120)),
        _t("hdmi cable", "", "4k hdmi cable", f"{_ELEC} › Television & Video › Accessories › Cables › HDMI Cables",
           ["4k", "high speed", "gold plated", "ethernet", "braided", "hdr support"],
           {"size": ["3 ft", "6 ft", "10 ft", "15 ft", "25 ft"], "style": PACKS}, (6, 30)),
        _t("power bank", "", "portable power bank", f"{_ELEC} › Cell Phones & Accessories › Chargers & Power Adapters",
           ["fast charging", "usb c", "led display", "compact", "dual output", "airline safe"],
           {"size": ["5000mah", "10000mah", "20000mah", "26800mah"], "color": ["black", "white", "blue"]},
           (15, 70)),
        _t("wireless mouse", "", "wireless mouse", f"{_ELEC} › Computers & Accessories › Mice",
           ["ergonomic", "silent click", "rechargeable", "adjustable dpi", "usb receiver", "bluetooth"],
           {"color": ["black", "white", "grey", "pink", "blue"]}, (8, 45)),
        _t("desk lamp", "", "led desk lamp", f"{_HOME} › Lighting › Lamps & Shades › Desk Lamps",
           ["dimmable", "usb charging port", "eye caring", "touch control", "adjustable arm", "energy efficient"],
           {"color": ["black", "white", "silver", "wood grain"]}, (15, 60)),
    ],
    "furniture": [
        _t("office chair", "", "ergonomic office chair", f"{_HOME} › Furniture › Home Office Furniture › Chairs",
           ["lumbar support", "adjustable height", "mesh back", "swivel", "padded armrests", "easy assembly"],
           {"color": ["black", "grey", "white", "navy", "brown"]}, (60, 300)),
        _t("bookshelf", "", "wooden bookshelf", f"{_HOME} › Furniture › Living Room Furniture › Bookcases",
           ["solid wood", "easy assembly", "adjustable shelves", "anti tip", "storage space", "industrial style"],
           {"color": ["walnut", "white", "black", "oak", "espresso"], "size": ["3 tier", "4 tier", "5 tier"]},
           (35, 200)),
        _t("coffee table", "", "coffee table", f"{_HOME} › Furniture › Living Room Furniture › Tables",
           ["storage shelf", "tempered glass", "solid wood", "lift top", "mid century", "easy assembly"],
           {"color": ["walnut", "white", "black", "oak", "grey"]}, (50, 250)),
        _t("bed frame", "", "metal bed frame", f"{_HOME} › Furniture › Bedroom Furniture › Beds & Frames",
           ["no box spring needed", "under bed storage", "noise free", "heavy duty", "upholstered", "headboard"],
           {"size": ["twin", "full", "queen", "king"], "color": ["black", "grey", "white", "brown"]}, (80, 400)),
        _t("nightstand", "", "nightstand with drawer", f"{_HOME} › Furniture › Bedroom Furniture › Nightstands",
           ["with drawer", "open shelf", "charging station", "solid wood", "easy assembly", "modern design"],
           {"color": ["walnut", "white", "black", "oak", "grey"], "style": ["set of 1", "set of 2"]}, (30, 150)),
        _t("throw pillow covers", "", "throw pillow covers", f"{_HOME} › Home Décor › Decorative Pillows",
           ["hidden zipper", "machine washable", "velvet", "double sided", "linen blend", "soft"],
           {"color": COLORS, "size": ["16x16 inch", "18x18 inch", "20x20 inch"]}, (8, 35)),
        _t("shower curtain", "", "fabric shower curtain", f"{_HOME} › Bath › Shower Curtains & Accessories",
           ["waterproof", "machine washable", "weighted hem", "hooks included", "mildew resistant", "waffle weave"],
           {"color": COLORS, "size": ["72x72 inch", "72x84 inch", "36x72 inch"]}, (10, 40)),
        _t("area rug", "", "area rug", f"{_HOME} › Home Décor › Rugs, Pads & Protectors › Area Rugs",
           ["non slip", "machine washable", "low pile", "stain resistant", "shag", "indoor outdoor"],
           {"color": COLORS, "size": ["3x5 feet", "4x6 feet", "5x7 feet", "8x10 feet"]}, (25, 220)),
    ],
}  # fmt: skip
