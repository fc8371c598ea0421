"""Check the built docs site's internal links, with no network: every relative href and
src of every HTML page points at a file of the site, and every #fragment at an id of
that page. External links (http:, https:, mailto:) are not followed.

    python tests/docs_links.py build/site       # ./dev docs runs it after the build
"""

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        for k in ("href", "src"):
            if a.get(k) and tag in ("a", "img", "link", "script"):
                self.links.append(a[k])


def check(site: Path) -> list:
    pages = {}
    for html in site.rglob("*.html"):
        p = _Page()
        p.feed(html.read_text(errors="replace"))
        pages[html.resolve()] = p
    bad = []
    for html, p in pages.items():
        if html.parent.name == "search" or "404" in html.name:
            continue
        for link in p.links:
            u = urlsplit(link)
            if u.scheme or link.startswith(("//", "mailto:")):
                continue
            target = (html.parent / unquote(u.path)).resolve() if u.path else html
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                bad.append(f"{html.relative_to(site.resolve())}: {link} (no such file)")
            elif u.fragment and target.suffix == ".html":
                ids = pages.get(target, _Page()).ids
                if u.fragment not in ids:
                    bad.append(f"{html.relative_to(site.resolve())}: {link} (no such anchor)")
    return bad


def main(site: str) -> int:
    root = Path(site)
    if not (root / "index.html").exists():
        print(f"{site}: no built site (run ./dev docs)", file=sys.stderr)
        return 2
    bad = check(root)
    for b in bad:
        print(f"broken link: {b}", file=sys.stderr)
    n = sum(1 for _ in root.rglob("*.html"))
    print(f"docs links: {n} pages, {len(bad)} broken")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "build/site"))
