"""Support tickets paired with the help-centre answer that resolves them: the embedding recipe's default data.

Each of the 40 kinds of issue the support tickets are written from (``support_tickets.ISSUES``) has one answer,
worded as a help-centre article would word it: in the customer's terms rarely, so that matching a ticket to its
answer is learnt, not read off shared words. A ticket's ``positive`` is its issue's answer; retrieval ranks every
answer for each held-out ticket, and held-out tickets word their issue in a way training never does.
"""

from __future__ import annotations

import random

from datasets import Dataset, DatasetDict, Features, Value

from finetune.data.embedded import EmbeddedDataset
from finetune.data.embedded.support_tickets import ISSUES, LABEL_NAMES, message

__all__ = ["ANSWERS", "REWORDED", "SUPPORT_ANSWERS", "make_support_answers"]

NUM_TRAIN, NUM_EVAL = 2400, 600
_SEED = 20261206

ANSWERS = {
    "billing": [
        "Duplicate charges: when a renewal is taken twice, the second payment is returned to the same card within "
        "five working days; send us both transaction references if it has not appeared.",
        "Invoice corrections: an invoice with a wrong total is reissued from the Billing page, where the corrected "
        "document replaces the old one for your records.",
        "Refund timing: refunds are sent on the day they are approved, and banks take up to ten days to show them "
        "on a statement.",
        "Price changes: plan prices are announced thirty days ahead by email, and the old price holds until your "
        "current term ends.",
        "Stopping renewal: switch off auto-renew under Subscription; the service stays active until the paid "
        "period runs out.",
        "Promotional codes: a voucher must be entered before payment; one that was missed can be credited to your "
        "next bill by our team.",
        "Tax documents: add your VAT or company registration number in Billing details and download a receipt "
        "that shows it for any period.",
        "Declined payments: a pending authorisation from a declined card is released by your bank within a few "
        "days and is never collected.",
        "Seat billing: removed seats stop costing from the next cycle, and a seat charged after removal is "
        "credited pro rata.",
        "Changing billing period: moving to annual billing applies a credit for the unused part of the month "
        "already paid.",
    ],
    "technical": [
        "App crashes on one screen: clear the local cache from the profile menu and reinstall the latest version; "
        "send us the crash report if it persists.",
        "Stalled synchronisation: sign out and back in to restart the sync queue; large libraries can take an "
        "hour on the first run after an update.",
        "Export errors: report exports fail when a filter matches no rows or the file passes the export limit; "
        "narrow the date range and try again.",
        "Browser loading problems: the web app supports the two latest versions of each major browser; disable "
        "extensions and clear site data.",
        "Missing alerts: after an update, check that the operating system still allows the app to send "
        "notifications and that quiet hours are off.",
        "Search results empty: the search index rebuilds overnight after large imports; items appear in results "
        "once it has finished.",
        "Upload limits: files above the size limit of your plan are rejected; compress the file or use the "
        "desktop client, which uploads in parts.",
        "Blank charts: dashboards show nothing when the data source connection has expired; reconnect it under "
        "Integrations.",
        "Calendar connection drops: reauthorise the calendar integration and make sure the connected account "
        "still has permission to edit events.",
        "High memory use on desktop: limit the number of workspaces kept offline and update the desktop client to "
        "the newest release.",
    ],
    "shipping": [
        "Parcels without tracking updates: carriers often scan only at depots; if nothing changes for a week we "
        "open an investigation with them.",
        "Tracking links not working: a new tracking number becomes active on the carrier's site up to a day after "
        "the label is printed.",
        "Damaged deliveries: photograph the packaging and the item and we send a replacement or a refund, without "
        "the need to return it.",
        "Wrong item sent: we ship the correct product at once and email a prepaid label for returning the one you "
        "received.",
        "Delivering to a different address: the address can be changed until the parcel leaves the warehouse, "
        "from the order page.",
        "Parcel left in the wrong place: ask neighbours first; the courier's proof of delivery shows where it was "
        "left and we claim for lost parcels.",
        "Marked delivered but not received: wait one working day, as carriers sometimes scan early, then we "
        "trace or replace the order.",
        "Express delivery times: express shipments reach most cities in one to two working days once dispatched.",
        "Incomplete orders: items may ship separately from different warehouses; check the order page before "
        "reporting a missing part.",
        "Rescheduling delivery: choose a new delivery day through the carrier's link in the dispatch email.",
    ],
    "account": [
        "Login failures after a reset: use the newest reset link only and check that the keyboard layout does not "
        "change your password.",
        "Changing your email: the address on your profile is updated under Security, after confirming the new one "
        "from its inbox.",
        "Locked accounts: an account locks for thirty minutes after repeated failed sign-ins and unlocks on its "
        "own.",
        "Adding administrators: an owner grants admin rights to a member under Team settings, Roles.",
        "Deleting an account: a deletion request removes the profile and all stored data within thirty days and "
        "cannot be undone.",
        "Two-step verification codes: codes by text can be delayed by phone networks; switch to an authenticator "
        "app for reliable codes.",
        "Suspicious sign-ins: end all sessions from Security, change your password and turn on two-step "
        "verification.",
        "Merging duplicate accounts: our team can move the data of one account into another once you confirm both "
        "addresses.",
        "Display name changes: the name shown to others is edited on the profile page and updates everywhere "
        "within minutes.",
        "Verification emails: look in spam and promotions folders, or resend the verification message from the "
        "sign-in page.",
    ],
}


REWORDED = {
    "billing": [
        "the same subscription payment for {plan} came out of my account two times",
        "the total on my {month} bill is not what we agreed",
        "still waiting for the money back for order {order}",
        "my plan costs more now and nobody told me",
        "stop charging me automatically when the term ends",
        "the promo {code} did not take anything off the total",
        "I need an official receipt for {month} that includes our VAT details",
        "payment failed at checkout yet my bank shows the money gone",
        "we are still paying for a user we took off the team in {month}",
        "I would rather pay once a year, what happens to this month's payment",
    ],
    "technical": [
        "opening {screen} closes the whole application",
        "the data has not updated since the new version, progress frozen at {percent}",
        "downloading a report gives me code {errcode}",
        "nothing appears in {browser}, the spinner just keeps turning",
        "I no longer get any alerts since updating to {version}",
        "typing a product name in the search bar finds no results although it exists",
        "files over {size} MB never finish uploading",
        "all the graphs on the home page are empty today",
        "events stop showing up because the calendar link breaks again and again",
        "the computer program eats all my RAM until everything hangs",
    ],
    "shipping": [
        "tracking for {order} shows no movement for {days} days now",
        "the courier website says the tracking code is invalid",
        "the box came crushed and the product is broken",
        "order {order} contained a product I never ordered",
        "please send the parcel to my workplace rather than my house",
        "the delivery person put my parcel at the neighbour's door",
        "the app says {order} was delivered but I have nothing",
        "what is the fastest shipping time to {city}",
        "the parcel for {order} arrived with one product not in it",
        "can the parcel come on {weekday} instead",
    ],
    "account": [
        "the new password does not let me in either",
        "I want my profile to use a different email address",
        "too many wrong passwords and now I am blocked",
        "how can a coworker get admin rights",
        "please erase my profile and everything you store about me",
        "the verification text message never arrives",
        "there was a login to my account from {city} that was not me",
        "I accidentally made two accounts, can they become one",
        "where do I edit the name other people see",
        "the confirmation email for my address never came",
    ],
}
"""Another wording of each of ``ISSUES``: the validation tickets are written in these, so that retrieval is
measured on tickets worded as training never words them."""


def _split(rng: random.Random, size: int, wordings: dict[str, list[str]]) -> dict[str, list]:
    intents = [(label, issue) for label in LABEL_NAMES for issue in range(len(wordings[label]))]
    anchors, positives = [], []
    for label, issue in rng.choices(intents, k=size):
        anchors.append(message(rng, label, wordings[label][issue]))
        positives.append(ANSWERS[label][issue])
    return {"anchor": anchors, "positive": positives}


def make_support_answers() -> DatasetDict:
    """``train`` (2,400) and ``validation`` (600) pairs: ``anchor`` a ticket, ``positive`` its issue's answer; the
    validation tickets worded anew (``REWORDED``)."""
    rng = random.Random(_SEED)
    features = Features({"anchor": Value("string"), "positive": Value("string")})
    return DatasetDict(train=Dataset.from_dict(_split(rng, NUM_TRAIN, ISSUES), features=features),
                       validation=Dataset.from_dict(_split(rng, NUM_EVAL, REWORDED), features=features))


SUPPORT_ANSWERS = EmbeddedDataset("support tickets and their answers (embedded default)", make_support_answers)
