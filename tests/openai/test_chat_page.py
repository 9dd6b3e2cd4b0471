"""The chat page at `/`, in headless Chromium (Debian's chromium + chromedriver, driven by
Selenium): type a question, see the answer stream in."""

import os
import shutil
import tempfile
import time

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from conftest import API_KEY


def browser(tmp, performance_log=False):
    """Chromium with its profile and its singleton-socket folder (which it makes in $TMPDIR
    and leaves behind) both inside `tmp`, so a run leaves nothing in /tmp. With
    `performance_log`, its network events can be read with `get_log("performance")`."""
    opts = webdriver.ChromeOptions()
    if performance_log:
        opts.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    opts.binary_location = "/usr/bin/chromium"
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              f"--user-data-dir={tmp}/profile"):
        opts.add_argument(a)
    env = dict(os.environ, TMPDIR=tmp)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver", env=env), options=opts)


def test_chat_page_streams_an_answer(server):
    tmp = tempfile.mkdtemp(prefix="ferrum-chromium-")
    try:
        d = browser(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        d.get(server.base + "/")
        key = d.find_element(By.ID, "apikey")
        key.send_keys(API_KEY)
        # The page lists models once it has the key.
        d.execute_script("arguments[0].dispatchEvent(new Event('change'))", key)
        WebDriverWait(d, 30).until(lambda d: d.find_element(By.ID, "model").get_attribute("value") == server.model)
        d.find_element(By.ID, "max_tokens").clear()
        d.find_element(By.ID, "max_tokens").send_keys("48")
        box = d.find_element(By.ID, "input")
        box.send_keys("Tell me about the ocean.")
        box.send_keys(Keys.ENTER)
        # Watch the answer grow: several distinct partial lengths before it is complete.
        seen = set()
        deadline = time.time() + 120
        done = False
        while time.time() < deadline:
            answers = d.find_elements(By.CSS_SELECTOR, ".msg.assistant")
            if answers:
                text = d.execute_script("return arguments[0].firstChild ? arguments[0].firstChild.textContent : ''", answers[-1])
                seen.add(len(text))
                if answers[-1].find_elements(By.CLASS_NAME, "meta"):
                    done = True
                    break
            time.sleep(0.01)
        assert done, "no complete answer"
        meta = d.find_element(By.CSS_SELECTOR, ".msg.assistant .meta").text
        assert "tok/s" in meta, meta
        assert len([n for n in seen if n > 0]) >= 3, f"not streamed: lengths seen {sorted(seen)}"
        user = d.find_elements(By.CSS_SELECTOR, ".msg.user")
        assert user[-1].text == "Tell me about the ocean."
        # The conversation is kept in the browser: a reload shows it again.
        d.refresh()
        WebDriverWait(d, 10).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg")) >= 2)
    finally:
        d.quit()
        shutil.rmtree(tmp, ignore_errors=True)


def test_chat_page_attaches_an_image(server):
    """An image attached with the Image button goes with the next message as an image_url part
    (shown in the user's bubble); this model has no vision tower, so the answer is the
    server's 400, shown under it."""
    tmp = tempfile.mkdtemp(prefix="ferrum-chromium-")
    try:
        d = browser(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        d.get(server.base + "/")
        d.execute_script("localStorage.clear()")
        d.refresh()
        key = d.find_element(By.ID, "apikey")
        key.send_keys(API_KEY)
        d.execute_script("arguments[0].dispatchEvent(new Event('change'))", key)
        WebDriverWait(d, 30).until(lambda d: d.find_element(By.ID, "model").get_attribute("value") == server.model)
        picker = d.find_element(By.ID, "file")
        d.execute_script("arguments[0].hidden = false", picker)
        png = os.path.join(os.path.dirname(__file__), "..", "fixtures", "vision", "processor", "rgb_9x7.png")
        picker.send_keys(os.path.abspath(png))
        WebDriverWait(d, 10).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#pending img"))
        box = d.find_element(By.ID, "input")
        box.send_keys("What is this?")
        box.send_keys(Keys.ENTER)
        WebDriverWait(d, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta"))
        meta = d.find_element(By.CSS_SELECTOR, ".msg.assistant .meta").text
        assert "does not take images" in meta, meta
        user = d.find_elements(By.CSS_SELECTOR, ".msg.user")[-1]
        assert user.find_elements(By.TAG_NAME, "img"), "the image is not in the bubble"
        assert "What is this?" in user.text
        assert not d.find_elements(By.CSS_SELECTOR, "#pending img")
    finally:
        d.quit()
        shutil.rmtree(tmp, ignore_errors=True)
