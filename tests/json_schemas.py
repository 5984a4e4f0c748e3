"""JSON schemas for structured outputs (issue 23): a suite of realistic ones, and hostile ones.

``SCHEMAS`` holds named schemas of the kinds applications send to ``response_format`` / tool
``parameters``: nested objects, arrays with ``minItems``/``maxItems``, enums, ``anyOf``/``oneOf``,
``$ref``/``$defs`` (recursive ones too), string patterns and formats, bounded numbers, optional
fields, ``additionalProperties: false``. They are written for cb-serve (shapes follow OpenAI's and
pydantic's output, GitHub's REST objects, RFC 7807 / RFC 6902, GeoJSON, Kubernetes); nothing is
downloaded. Each is valid under the draft it declares (2020-12 unless ``$schema`` says draft-07),
and uses only keywords that llguidance 1.9 and xgrammar 0.2.8 both compile (all of them do;
xgrammar drops some bounds of one, see ``pydantic_user_profile``); ``pattern``s are anchored (``^...$``)
so that both engines and ``jsonschema`` (which searches) agree on them. Two schemas
(``key_heavy_*``) have many long fixed property names, for jump-forward measurements.

``HOSTILE_SCHEMAS`` are for the 400 tests: a ``$ref`` bomb, a 10,000-member enum, a ~1 MB schema,
an invalid schema and an invalid regex.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

_DRAFT_2020 = "https://json-schema.org/draft/2020-12/schema"
_DRAFT_07 = "http://json-schema.org/draft-07/schema#"

_ADDRESS: Schema = {
    "type": "object",
    "properties": {
        "street": {"type": "string", "minLength": 1, "maxLength": 100},
        "city": {"type": "string", "minLength": 1, "maxLength": 60},
        "postal_code": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"},
        "country": {"type": "string", "enum": ["US", "CA", "GB", "DE", "FR", "JP", "IN", "BR"]},
    },
    "required": ["street", "city", "postal_code", "country"],
    "additionalProperties": False,
}

SCHEMAS: list[tuple[str, Schema]] = [
    (
        "product",
        {
            "$schema": _DRAFT_2020,
            "title": "Product",
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 80},
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4,6}$"},
                "price": {"type": "number", "minimum": 0, "maximum": 100000},
                "currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]},
                "in_stock": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
            },
            "required": ["name", "sku", "price", "currency", "in_stock"],
            "additionalProperties": False,
        },
    ),
    (
        "postal_address",
        {
            "$schema": _DRAFT_2020,
            "title": "PostalAddress",
            "type": "object",
            "properties": {
                "recipient": {"type": "string", "maxLength": 80},
                "street": {"type": "string", "minLength": 1, "maxLength": 100},
                "unit": {"type": "string", "maxLength": 20},
                "city": {"type": "string", "minLength": 1, "maxLength": 60},
                "state": {"type": "string", "pattern": "^[A-Z]{2}$"},
                "postal_code": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"},
                "country": {"type": "string", "const": "US"},
            },
            "required": ["recipient", "street", "city", "state", "postal_code", "country"],
            "additionalProperties": False,
        },
    ),
    (
        "invoice",
        {
            "$schema": _DRAFT_2020,
            "title": "Invoice",
            "type": "object",
            "$defs": {
                "money": {
                    "type": "object",
                    "properties": {
                        "amount": {"type": "number", "minimum": 0},
                        "currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
                    },
                    "required": ["amount", "currency"],
                    "additionalProperties": False,
                },
                "party": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "tax_id": {"type": "string", "pattern": "^[A-Z]{2}[0-9A-Z]{8,12}$"},
                        "address": {"$ref": "#/$defs/address"},
                    },
                    "required": ["name", "address"],
                    "additionalProperties": False,
                },
                "address": _ADDRESS,
                "line_item": {
                    "type": "object",
                    "properties": {
                        "description": {"type": "string", "minLength": 1, "maxLength": 120},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 10000},
                        "unit_price": {"$ref": "#/$defs/money"},
                        "tax_rate": {"type": "number", "minimum": 0, "maximum": 0.5},
                    },
                    "required": ["description", "quantity", "unit_price"],
                    "additionalProperties": False,
                },
            },
            "properties": {
                "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
                "issue_date": {"type": "string", "format": "date"},
                "due_date": {"type": "string", "format": "date"},
                "seller": {"$ref": "#/$defs/party"},
                "buyer": {"$ref": "#/$defs/party"},
                "line_items": {"type": "array", "items": {"$ref": "#/$defs/line_item"}, "minItems": 1, "maxItems": 20},
                "total": {"$ref": "#/$defs/money"},
                "notes": {"type": "string", "maxLength": 500},
            },
            "required": ["invoice_number", "issue_date", "seller", "buyer", "line_items", "total"],
            "additionalProperties": False,
        },
    ),
    (
        "calendar_event",
        {
            "$schema": _DRAFT_2020,
            "title": "CalendarEvent",
            "type": "object",
            "properties": {
                "title": {"type": "string", "minLength": 1, "maxLength": 120},
                "start": {"type": "string", "format": "date-time"},
                "end": {"type": "string", "format": "date-time"},
                "all_day": {"type": "boolean"},
                "location": {"type": "string", "maxLength": 200},
                "attendees": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "email": {"type": "string", "format": "email"},
                            "name": {"type": "string"},
                            "response": {
                                "type": "string",
                                "enum": ["accepted", "declined", "tentative", "needs_action"],
                            },
                            "optional": {"type": "boolean"},
                        },
                        "required": ["email", "response"],
                        "additionalProperties": False,
                    },
                    "maxItems": 10,
                },
                "reminders": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "method": {"type": "string", "enum": ["email", "popup"]},
                            "minutes_before": {"type": "integer", "minimum": 0, "maximum": 40320},
                        },
                        "required": ["method", "minutes_before"],
                        "additionalProperties": False,
                    },
                    "maxItems": 5,
                },
                "recurrence": {
                    "type": "string",
                    "pattern": "^RRULE:FREQ=(DAILY|WEEKLY|MONTHLY|YEARLY)(;[A-Z]+=[A-Z0-9,]+)*$",
                },
            },
            "required": ["title", "start", "end"],
            "additionalProperties": False,
        },
    ),
    (
        "github_issue",
        {
            "$schema": _DRAFT_2020,
            "title": "Issue",
            "type": "object",
            "$defs": {
                "user": {
                    "type": "object",
                    "properties": {
                        "login": {"type": "string", "pattern": "^[A-Za-z0-9](-?[A-Za-z0-9]){0,38}$"},
                        "id": {"type": "integer", "minimum": 1},
                        "html_url": {"type": "string", "format": "uri"},
                        "type": {"type": "string", "enum": ["User", "Bot", "Organization"]},
                    },
                    "required": ["login", "id", "type"],
                    "additionalProperties": False,
                },
            },
            "properties": {
                "number": {"type": "integer", "minimum": 1},
                "title": {"type": "string", "minLength": 1, "maxLength": 256},
                "body": {"anyOf": [{"type": "string", "maxLength": 2000}, {"type": "null"}]},
                "state": {"type": "string", "enum": ["open", "closed"]},
                "state_reason": {
                    "anyOf": [{"type": "string", "enum": ["completed", "not_planned", "reopened"]}, {"type": "null"}]
                },
                "user": {"$ref": "#/$defs/user"},
                "assignees": {"type": "array", "items": {"$ref": "#/$defs/user"}, "maxItems": 10},
                "labels": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "minLength": 1, "maxLength": 50},
                            "color": {"type": "string", "pattern": "^[0-9a-f]{6}$"},
                        },
                        "required": ["name", "color"],
                        "additionalProperties": False,
                    },
                    "maxItems": 20,
                },
                "comments": {"type": "integer", "minimum": 0},
                "created_at": {"type": "string", "format": "date-time"},
                "html_url": {"type": "string", "format": "uri"},
            },
            "required": ["number", "title", "state", "user", "labels", "created_at"],
            "additionalProperties": False,
        },
    ),
    (
        "tool_get_weather",
        # OpenAI function-calling ``parameters`` in strict mode: every property required, no extras.
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "City and country, e.g. Paris, France"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location", "unit"],
            "additionalProperties": False,
        },
    ),
    (
        "tool_search_flights",
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "origin": {"type": "string", "pattern": "^[A-Z]{3}$", "description": "IATA airport code"},
                "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "departure_date": {"type": "string", "format": "date"},
                "return_date": {"anyOf": [{"type": "string", "format": "date"}, {"type": "null"}]},
                "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                "cabin": {"type": "string", "enum": ["economy", "premium_economy", "business", "first"]},
                "max_stops": {"type": "integer", "minimum": 0, "maximum": 3},
            },
            "required": ["origin", "destination", "departure_date", "return_date", "passengers", "cabin", "max_stops"],
            "additionalProperties": False,
        },
    ),
    (
        "tool_run_sql",
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "database": {"type": "string", "enum": ["analytics", "billing", "users"]},
                "query": {"type": "string", "minLength": 1, "maxLength": 2000},
                "parameters": {
                    "type": "array",
                    "items": {"type": ["string", "number", "boolean", "null"]},
                    "maxItems": 16,
                },
                "row_limit": {"type": "integer", "minimum": 1, "maximum": 1000},
                "read_only": {"type": "boolean"},
            },
            "required": ["database", "query"],
            "additionalProperties": False,
        },
    ),
    (
        "recipe",
        {
            "$schema": _DRAFT_2020,
            "title": "Recipe",
            "type": "object",
            "properties": {
                "title": {"type": "string", "minLength": 1, "maxLength": 100},
                "cuisine": {
                    "type": "string",
                    "enum": ["italian", "french", "mexican", "indian", "chinese", "japanese", "american", "other"],
                },
                "servings": {"type": "integer", "minimum": 1, "maximum": 50},
                "prep_minutes": {"type": "integer", "minimum": 0, "maximum": 600},
                "cook_minutes": {"type": "integer", "minimum": 0, "maximum": 1440},
                "ingredients": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "quantity": {"type": "number", "exclusiveMinimum": 0},
                            "unit": {
                                "type": "string",
                                "enum": ["g", "kg", "ml", "l", "tsp", "tbsp", "cup", "piece", "pinch"],
                            },
                        },
                        "required": ["name", "quantity", "unit"],
                        "additionalProperties": False,
                    },
                    "minItems": 1,
                    "maxItems": 30,
                },
                "steps": {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 20},
                "vegetarian": {"type": "boolean"},
            },
            "required": ["title", "servings", "ingredients", "steps"],
            "additionalProperties": False,
        },
    ),
    (
        "person_optional_fields",
        {
            "$schema": _DRAFT_2020,
            "title": "Person",
            "type": "object",
            "$defs": {"address": _ADDRESS},
            "properties": {
                "given_name": {"type": "string", "minLength": 1, "maxLength": 50},
                "family_name": {"type": "string", "minLength": 1, "maxLength": 50},
                "middle_name": {"type": "string", "maxLength": 50},
                "email": {"type": "string", "format": "email"},
                "phone": {"type": "string", "pattern": "^\\+[1-9][0-9]{6,14}$"},
                "birth_date": {"type": "string", "format": "date"},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "nicknames": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                "home_address": {"$ref": "#/$defs/address"},
                "website": {"type": "string", "format": "uri"},
            },
            "required": ["given_name", "family_name"],
            "additionalProperties": False,
        },
    ),
    (
        "classification",
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "category": {
                    "type": "string",
                    "enum": [
                        "billing",
                        "technical_support",
                        "account_access",
                        "feature_request",
                        "bug_report",
                        "cancellation",
                        "sales_inquiry",
                        "other",
                    ],
                },
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                "urgent": {"type": "boolean"},
            },
            "required": ["category", "confidence", "urgent"],
            "additionalProperties": False,
        },
    ),
    (
        "sentiment_anyof",
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "sentiment": {"type": "string", "enum": ["positive", "neutral", "negative", "mixed"]},
                "score": {"anyOf": [{"type": "number", "minimum": -1, "maximum": 1}, {"type": "null"}]},
                "aspects": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "aspect": {"type": "string", "maxLength": 40},
                            "polarity": {
                                "anyOf": [
                                    {"type": "string", "enum": ["positive", "negative"]},
                                    {"type": "integer", "minimum": -5, "maximum": 5},
                                ]
                            },
                        },
                        "required": ["aspect", "polarity"],
                        "additionalProperties": False,
                    },
                    "maxItems": 5,
                },
            },
            "required": ["sentiment", "score"],
            "additionalProperties": False,
        },
    ),
    (
        "shape_oneof",
        # A discriminated union: the ``kind`` const tells the branches apart, so oneOf = anyOf here.
        {
            "$schema": _DRAFT_2020,
            "oneOf": [
                {
                    "type": "object",
                    "properties": {
                        "kind": {"const": "circle"},
                        "radius": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                    },
                    "required": ["kind", "radius"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {
                        "kind": {"const": "rectangle"},
                        "width": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                        "height": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                    },
                    "required": ["kind", "width", "height"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {
                        "kind": {"const": "polygon"},
                        "points": {
                            "type": "array",
                            "items": {
                                "type": "array",
                                "items": {"type": "number"},
                                "minItems": 2,
                                "maxItems": 2,
                            },
                            "minItems": 3,
                            "maxItems": 12,
                        },
                    },
                    "required": ["kind", "points"],
                    "additionalProperties": False,
                },
            ],
        },
    ),
    (
        "payment_method_oneof",
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "customer_id": {"type": "string", "pattern": "^cus_[A-Za-z0-9]{8,16}$"},
                "method": {
                    "oneOf": [
                        {
                            "type": "object",
                            "properties": {
                                "type": {"const": "card"},
                                "brand": {"type": "string", "enum": ["visa", "mastercard", "amex", "discover"]},
                                "last4": {"type": "string", "pattern": "^[0-9]{4}$"},
                                "exp_month": {"type": "integer", "minimum": 1, "maximum": 12},
                                "exp_year": {"type": "integer", "minimum": 2024, "maximum": 2045},
                            },
                            "required": ["type", "brand", "last4", "exp_month", "exp_year"],
                            "additionalProperties": False,
                        },
                        {
                            "type": "object",
                            "properties": {
                                "type": {"const": "sepa_debit"},
                                "iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{11,30}$"},
                                "account_holder": {"type": "string", "minLength": 1},
                            },
                            "required": ["type", "iban", "account_holder"],
                            "additionalProperties": False,
                        },
                        {
                            "type": "object",
                            "properties": {
                                "type": {"const": "wallet"},
                                "provider": {"type": "string", "enum": ["apple_pay", "google_pay", "paypal"]},
                            },
                            "required": ["type", "provider"],
                            "additionalProperties": False,
                        },
                    ]
                },
                "default": {"type": "boolean"},
            },
            "required": ["customer_id", "method"],
            "additionalProperties": False,
        },
    ),
    (
        "sensor_reading",
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "device_id": {"type": "string", "format": "uuid"},
                "timestamp": {"type": "string", "format": "date-time"},
                "temperature_c": {"type": "number", "minimum": -40, "maximum": 125},
                "humidity_pct": {"type": "number", "minimum": 0, "maximum": 100},
                "pressure_hpa": {"type": "number", "minimum": 300, "maximum": 1100},
                "battery_v": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 5},
                "rssi_dbm": {"type": "integer", "minimum": -120, "maximum": 0},
                "status": {"type": "string", "enum": ["ok", "degraded", "fault"]},
            },
            "required": ["device_id", "timestamp", "temperature_c", "humidity_pct", "status"],
            "additionalProperties": False,
        },
    ),
    (
        "keywords_min_max_items",
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "keywords": {
                    "type": "array",
                    "items": {"type": "string", "minLength": 2, "maxLength": 30},
                    "minItems": 3,
                    "maxItems": 5,
                },
                "language": {"type": "string", "pattern": "^[a-z]{2}$"},
            },
            "required": ["keywords", "language"],
            "additionalProperties": False,
        },
    ),
    (
        "geojson_feature",
        {
            "$schema": _DRAFT_2020,
            "title": "GeoJSON Feature (Point or LineString)",
            "type": "object",
            "$defs": {
                "position": {
                    "type": "array",
                    "prefixItems": [
                        {"type": "number", "minimum": -180, "maximum": 180},
                        {"type": "number", "minimum": -90, "maximum": 90},
                    ],
                    "items": False,
                    "minItems": 2,
                },
            },
            "properties": {
                "type": {"const": "Feature"},
                "geometry": {
                    "oneOf": [
                        {
                            "type": "object",
                            "properties": {"type": {"const": "Point"}, "coordinates": {"$ref": "#/$defs/position"}},
                            "required": ["type", "coordinates"],
                            "additionalProperties": False,
                        },
                        {
                            "type": "object",
                            "properties": {
                                "type": {"const": "LineString"},
                                "coordinates": {
                                    "type": "array",
                                    "items": {"$ref": "#/$defs/position"},
                                    "minItems": 2,
                                    "maxItems": 50,
                                },
                            },
                            "required": ["type", "coordinates"],
                            "additionalProperties": False,
                        },
                    ]
                },
                "properties": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "elevation_m": {"type": "number", "minimum": -500, "maximum": 9000},
                    },
                    "required": ["name"],
                    "additionalProperties": False,
                },
            },
            "required": ["type", "geometry", "properties"],
            "additionalProperties": False,
        },
    ),
    (
        "org_chart_nested",
        # Five object levels: company > departments[] > teams[] > members[] > contact.
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "company": {"type": "string", "minLength": 1},
                "departments": {
                    "type": "array",
                    "maxItems": 4,
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "teams": {
                                "type": "array",
                                "maxItems": 4,
                                "items": {
                                    "type": "object",
                                    "properties": {
                                        "name": {"type": "string"},
                                        "members": {
                                            "type": "array",
                                            "maxItems": 8,
                                            "items": {
                                                "type": "object",
                                                "properties": {
                                                    "name": {"type": "string"},
                                                    "role": {
                                                        "type": "string",
                                                        "enum": ["lead", "engineer", "designer", "manager"],
                                                    },
                                                    "contact": {
                                                        "type": "object",
                                                        "properties": {
                                                            "email": {"type": "string", "format": "email"},
                                                            "extension": {"type": "string", "pattern": "^[0-9]{3,5}$"},
                                                        },
                                                        "required": ["email"],
                                                        "additionalProperties": False,
                                                    },
                                                },
                                                "required": ["name", "role", "contact"],
                                                "additionalProperties": False,
                                            },
                                        },
                                    },
                                    "required": ["name", "members"],
                                    "additionalProperties": False,
                                },
                            },
                        },
                        "required": ["name", "teams"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["company", "departments"],
            "additionalProperties": False,
        },
    ),
    (
        "app_config_nested",
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "service": {"type": "string", "pattern": "^[a-z][a-z0-9-]{1,30}$"},
                "server": {
                    "type": "object",
                    "properties": {
                        "host": {"type": "string", "format": "hostname"},
                        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                        "tls": {
                            "type": "object",
                            "properties": {
                                "enabled": {"type": "boolean"},
                                "min_version": {"type": "string", "enum": ["1.2", "1.3"]},
                                "certificate": {
                                    "type": "object",
                                    "properties": {
                                        "path": {"type": "string", "pattern": "^/[^\\x00]*$"},
                                        "expires": {"type": "string", "format": "date"},
                                    },
                                    "required": ["path"],
                                    "additionalProperties": False,
                                },
                            },
                            "required": ["enabled"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["host", "port"],
                    "additionalProperties": False,
                },
                "database": {
                    "type": "object",
                    "properties": {
                        "engine": {"type": "string", "enum": ["postgres", "mysql", "sqlite"]},
                        "pool_size": {"type": "integer", "minimum": 1, "maximum": 200},
                        "timeout_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 300},
                    },
                    "required": ["engine"],
                    "additionalProperties": False,
                },
                "log_level": {"type": "string", "enum": ["debug", "info", "warning", "error"]},
            },
            "required": ["service", "server", "log_level"],
            "additionalProperties": False,
        },
    ),
    (
        "key_heavy_customer_profile",
        # Many long fixed keys, all required, short values: most tokens are forced (jump-forward).
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "customer_account_identifier": {"type": "integer", "minimum": 1},
                "primary_contact_full_legal_name": {"type": "string", "maxLength": 60},
                "subscription_plan_tier_name": {"type": "string", "enum": ["free", "pro", "enterprise"]},
                "is_eligible_for_promotional_discount": {"type": "boolean"},
                "has_accepted_latest_terms_of_service": {"type": "boolean"},
                "preferred_communication_channel": {"type": "string", "enum": ["email", "sms", "phone"]},
                "number_of_active_user_seats_purchased": {"type": "integer", "minimum": 0, "maximum": 10000},
                "account_creation_calendar_date": {"type": "string", "format": "date"},
                "most_recent_successful_login_timestamp": {"type": "string", "format": "date-time"},
                "lifetime_customer_value_in_us_dollars": {"type": "number", "minimum": 0},
                "requires_manual_invoice_review_by_finance": {"type": "boolean"},
                "assigned_customer_success_manager_email": {"type": "string", "format": "email"},
                "two_factor_authentication_is_enabled": {"type": "boolean"},
                "marketing_email_subscription_opt_in_status": {"type": "boolean"},
                "outstanding_support_ticket_count": {"type": "integer", "minimum": 0, "maximum": 1000},
                "annual_contract_renewal_is_automatic": {"type": "boolean"},
            },
            "required": [
                "customer_account_identifier",
                "primary_contact_full_legal_name",
                "subscription_plan_tier_name",
                "is_eligible_for_promotional_discount",
                "has_accepted_latest_terms_of_service",
                "preferred_communication_channel",
                "number_of_active_user_seats_purchased",
                "account_creation_calendar_date",
                "most_recent_successful_login_timestamp",
                "lifetime_customer_value_in_us_dollars",
                "requires_manual_invoice_review_by_finance",
                "assigned_customer_success_manager_email",
                "two_factor_authentication_is_enabled",
                "marketing_email_subscription_opt_in_status",
                "outstanding_support_ticket_count",
                "annual_contract_renewal_is_automatic",
            ],
            "additionalProperties": False,
        },
    ),
    (
        "key_heavy_onboarding_checklist",
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "employee_identification_number": {"type": "string", "pattern": "^E[0-9]{6}$"},
                "signed_employment_contract_received": {"type": "boolean"},
                "background_verification_check_completed": {"type": "boolean"},
                "corporate_laptop_hardware_provisioned": {"type": "boolean"},
                "single_sign_on_account_activated": {"type": "boolean"},
                "mandatory_security_awareness_training_passed": {"type": "boolean"},
                "payroll_direct_deposit_information_submitted": {"type": "boolean"},
                "emergency_contact_details_recorded": {"type": "boolean"},
                "health_insurance_enrollment_form_completed": {"type": "boolean"},
                "building_access_badge_photo_uploaded": {"type": "boolean"},
                "assigned_onboarding_buddy_employee_identification_number": {
                    "type": "string",
                    "pattern": "^E[0-9]{6}$",
                },
                "first_week_orientation_schedule_acknowledged": {"type": "boolean"},
            },
            "required": [
                "employee_identification_number",
                "signed_employment_contract_received",
                "background_verification_check_completed",
                "corporate_laptop_hardware_provisioned",
                "single_sign_on_account_activated",
                "mandatory_security_awareness_training_passed",
                "payroll_direct_deposit_information_submitted",
                "emergency_contact_details_recorded",
                "health_insurance_enrollment_form_completed",
                "building_access_badge_photo_uploaded",
                "assigned_onboarding_buddy_employee_identification_number",
                "first_week_orientation_schedule_acknowledged",
            ],
            "additionalProperties": False,
        },
    ),
    (
        "formats_bag",
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "id": {"type": "string", "format": "uuid"},
                "contact": {"type": "string", "format": "email"},
                "homepage": {"type": "string", "format": "uri"},
                "birthday": {"type": "string", "format": "date"},
                "created": {"type": "string", "format": "date-time"},
                "alarm": {"type": "string", "format": "time"},
                "server_ip": {"type": "string", "format": "ipv4"},
                "server_name": {"type": "string", "format": "hostname"},
            },
            "required": ["id", "contact", "homepage", "birthday", "created"],
            "additionalProperties": False,
        },
    ),
    (
        "problem_details_rfc7807",
        {
            "$schema": _DRAFT_2020,
            "title": "Problem Details (RFC 7807)",
            "type": "object",
            "properties": {
                "type": {"type": "string", "format": "uri"},
                "title": {"type": "string", "maxLength": 120},
                "status": {"type": "integer", "minimum": 100, "maximum": 599},
                "detail": {"type": "string", "maxLength": 1000},
                "instance": {"type": "string", "pattern": "^/[A-Za-z0-9/_-]*$"},
                "invalid_params": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}, "reason": {"type": "string"}},
                        "required": ["name", "reason"],
                        "additionalProperties": False,
                    },
                    "maxItems": 10,
                },
            },
            "required": ["type", "title", "status"],
            "additionalProperties": False,
        },
    ),
    (
        "order_tracking",
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "order_id": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{7}-[0-9]{7}$"},
                "status": {
                    "type": "string",
                    "enum": ["pending", "shipped", "in_transit", "delivered", "returned", "cancelled"],
                },
                "shipments": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "carrier": {"type": "string", "enum": ["UPS", "FedEx", "USPS", "DHL"]},
                            "tracking_number": {"type": "string", "pattern": "^[A-Z0-9]{10,22}$"},
                            "events": {
                                "type": "array",
                                "maxItems": 10,
                                "items": {
                                    "type": "object",
                                    "properties": {
                                        "timestamp": {"type": "string", "format": "date-time"},
                                        "location": {"type": "string"},
                                        "description": {"type": "string", "maxLength": 100},
                                    },
                                    "required": ["timestamp", "description"],
                                    "additionalProperties": False,
                                },
                            },
                        },
                        "required": ["carrier", "tracking_number", "events"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["order_id", "status", "shipments"],
            "additionalProperties": False,
        },
    ),
    (
        "movie_review",
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "title": {"type": "string", "minLength": 1},
                "year": {"type": "integer", "minimum": 1888, "maximum": 2030},
                "rating": {"type": "number", "minimum": 0, "maximum": 10},
                "genres": {
                    "type": "array",
                    "items": {
                        "type": "string",
                        "enum": [
                            "action",
                            "comedy",
                            "drama",
                            "horror",
                            "sci-fi",
                            "romance",
                            "documentary",
                            "animation",
                        ],
                    },
                    "minItems": 1,
                    "maxItems": 3,
                },
                "pros": {"type": "array", "items": {"type": "string", "maxLength": 80}, "maxItems": 5},
                "cons": {"type": "array", "items": {"type": "string", "maxLength": 80}, "maxItems": 5},
                "contains_spoilers": {"type": "boolean"},
                "summary": {"type": "string", "maxLength": 300},
            },
            "required": ["title", "year", "rating", "genres", "contains_spoilers"],
            "additionalProperties": False,
        },
    ),
    (
        "named_entities",
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "entities": {
                    "type": "array",
                    "maxItems": 20,
                    "items": {
                        "type": "object",
                        "properties": {
                            "text": {"type": "string", "minLength": 1},
                            "label": {
                                "type": "string",
                                "enum": ["PERSON", "ORG", "LOC", "DATE", "MONEY", "PRODUCT", "EVENT"],
                            },
                            "start": {"type": "integer", "minimum": 0},
                            "end": {"type": "integer", "minimum": 0},
                        },
                        "required": ["text", "label", "start", "end"],
                        "additionalProperties": False,
                    },
                }
            },
            "required": ["entities"],
            "additionalProperties": False,
        },
    ),
    (
        "qa_with_citations",
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "answer": {"type": "string", "minLength": 1, "maxLength": 1000},
                "citations": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "source_id": {"type": "string", "pattern": "^doc-[0-9]{1,4}$"},
                            "quote": {"type": "string", "maxLength": 200},
                        },
                        "required": ["source_id", "quote"],
                        "additionalProperties": False,
                    },
                    "minItems": 1,
                    "maxItems": 4,
                },
                "confidence": {"type": "string", "enum": ["high", "medium", "low"]},
            },
            "required": ["answer", "citations", "confidence"],
            "additionalProperties": False,
        },
    ),
    (
        "json_patch_rfc6902",
        # RFC 6902 operations as a oneOf on ``op``; ``value`` is any JSON.
        {
            "$schema": _DRAFT_2020,
            "type": "array",
            "minItems": 1,
            "maxItems": 10,
            "$defs": {"pointer": {"type": "string", "pattern": "^(/([^/~]|~[01])*)*$"}},
            "items": {
                "oneOf": [
                    {
                        "type": "object",
                        "properties": {
                            "op": {"type": "string", "enum": ["add", "replace", "test"]},
                            "path": {"$ref": "#/$defs/pointer"},
                            "value": {},
                        },
                        "required": ["op", "path", "value"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {"op": {"const": "remove"}, "path": {"$ref": "#/$defs/pointer"}},
                        "required": ["op", "path"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {
                            "op": {"type": "string", "enum": ["move", "copy"]},
                            "from": {"$ref": "#/$defs/pointer"},
                            "path": {"$ref": "#/$defs/pointer"},
                        },
                        "required": ["op", "from", "path"],
                        "additionalProperties": False,
                    },
                ]
            },
        },
    ),
    (
        "comment_thread_recursive",
        # A recursive $ref: each comment holds replies that are comments.
        {
            "$schema": _DRAFT_2020,
            "$ref": "#/$defs/comment",
            "$defs": {
                "comment": {
                    "type": "object",
                    "properties": {
                        "author": {"type": "string", "minLength": 1, "maxLength": 40},
                        "text": {"type": "string", "minLength": 1, "maxLength": 500},
                        "upvotes": {"type": "integer", "minimum": 0},
                        "replies": {"type": "array", "items": {"$ref": "#/$defs/comment"}, "maxItems": 5},
                    },
                    "required": ["author", "text", "replies"],
                    "additionalProperties": False,
                }
            },
        },
    ),
    (
        "filesystem_tree_recursive",
        {
            "$schema": _DRAFT_2020,
            "$defs": {
                "file": {
                    "type": "object",
                    "properties": {
                        "type": {"const": "file"},
                        "name": {"type": "string", "pattern": "^[^/]{1,64}$"},
                        "size_bytes": {"type": "integer", "minimum": 0},
                    },
                    "required": ["type", "name", "size_bytes"],
                    "additionalProperties": False,
                },
                "directory": {
                    "type": "object",
                    "properties": {
                        "type": {"const": "directory"},
                        "name": {"type": "string", "pattern": "^[^/]{1,64}$"},
                        "children": {
                            "type": "array",
                            "items": {"anyOf": [{"$ref": "#/$defs/file"}, {"$ref": "#/$defs/directory"}]},
                            "maxItems": 20,
                        },
                    },
                    "required": ["type", "name", "children"],
                    "additionalProperties": False,
                },
            },
            "$ref": "#/$defs/directory",
        },
    ),
    (
        "job_posting",
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "title": {"type": "string", "minLength": 3, "maxLength": 100},
                "company": {"type": "string", "minLength": 1},
                "employment_type": {"type": "string", "enum": ["full_time", "part_time", "contract", "internship"]},
                "location": {
                    "type": "object",
                    "properties": {
                        "remote": {"type": "boolean"},
                        "city": {"type": "string"},
                        "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
                    },
                    "required": ["remote"],
                    "additionalProperties": False,
                },
                "salary": {
                    "type": "object",
                    "properties": {
                        "min": {"type": "integer", "minimum": 0, "maximum": 1000000},
                        "max": {"type": "integer", "minimum": 0, "maximum": 1000000},
                        "currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "INR"]},
                        "period": {"type": "string", "enum": ["hour", "month", "year"]},
                    },
                    "required": ["min", "max", "currency", "period"],
                    "additionalProperties": False,
                },
                "skills": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 30},
                    "minItems": 1,
                    "maxItems": 10,
                },
                "posted": {"type": "string", "format": "date"},
                "apply_url": {"type": "string", "format": "uri"},
            },
            "required": ["title", "company", "employment_type", "location", "skills", "posted"],
            "additionalProperties": False,
        },
    ),
    (
        "meeting_action_items",
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "meeting_title": {"type": "string"},
                "date": {"type": "string", "format": "date"},
                "attendees": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 15},
                "decisions": {"type": "array", "items": {"type": "string", "maxLength": 200}, "maxItems": 10},
                "action_items": {
                    "type": "array",
                    "maxItems": 10,
                    "items": {
                        "type": "object",
                        "properties": {
                            "owner": {"type": "string"},
                            "task": {"type": "string", "minLength": 1, "maxLength": 200},
                            "due": {"type": "string", "format": "date"},
                            "priority": {"type": "string", "enum": ["P0", "P1", "P2", "P3"]},
                        },
                        "required": ["owner", "task", "priority"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["meeting_title", "date", "attendees", "action_items"],
            "additionalProperties": False,
        },
    ),
    (
        "http_request",
        # ``headers`` and ``query`` are maps (additionalProperties with a schema); ``body`` is a union.
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "method": {"type": "string", "enum": ["GET", "POST", "PUT", "PATCH", "DELETE"]},
                "url": {"type": "string", "format": "uri"},
                "headers": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 200}},
                "query": {"type": "object", "additionalProperties": {"type": ["string", "integer", "boolean"]}},
                "body": {"anyOf": [{"type": "object"}, {"type": "string"}, {"type": "null"}]},
                "timeout_ms": {"type": "integer", "minimum": 1, "maximum": 60000},
            },
            "required": ["method", "url"],
            "additionalProperties": False,
        },
    ),
    (
        "k8s_deployment",
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "$defs": {
                "dns_label": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"},
                "quantity": {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?(m|Ki|Mi|Gi)?$"},
            },
            "properties": {
                "apiVersion": {"const": "apps/v1"},
                "kind": {"const": "Deployment"},
                "metadata": {
                    "type": "object",
                    "properties": {
                        "name": {"$ref": "#/$defs/dns_label"},
                        "namespace": {"$ref": "#/$defs/dns_label"},
                        "labels": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 63}},
                    },
                    "required": ["name"],
                    "additionalProperties": False,
                },
                "spec": {
                    "type": "object",
                    "properties": {
                        "replicas": {"type": "integer", "minimum": 0, "maximum": 100},
                        "containers": {
                            "type": "array",
                            "minItems": 1,
                            "maxItems": 4,
                            "items": {
                                "type": "object",
                                "properties": {
                                    "name": {"$ref": "#/$defs/dns_label"},
                                    "image": {"type": "string", "pattern": "^[a-z0-9./-]+(:[A-Za-z0-9._-]+)?$"},
                                    "ports": {
                                        "type": "array",
                                        "maxItems": 4,
                                        "items": {
                                            "type": "object",
                                            "properties": {
                                                "containerPort": {"type": "integer", "minimum": 1, "maximum": 65535},
                                                "protocol": {"type": "string", "enum": ["TCP", "UDP", "SCTP"]},
                                            },
                                            "required": ["containerPort"],
                                            "additionalProperties": False,
                                        },
                                    },
                                    "resources": {
                                        "type": "object",
                                        "properties": {
                                            "limits": {
                                                "type": "object",
                                                "properties": {
                                                    "cpu": {"$ref": "#/$defs/quantity"},
                                                    "memory": {"$ref": "#/$defs/quantity"},
                                                },
                                                "additionalProperties": False,
                                            }
                                        },
                                        "additionalProperties": False,
                                    },
                                },
                                "required": ["name", "image"],
                                "additionalProperties": False,
                            },
                        },
                    },
                    "required": ["replicas", "containers"],
                    "additionalProperties": False,
                },
            },
            "required": ["apiVersion", "kind", "metadata", "spec"],
            "additionalProperties": False,
        },
    ),
    (
        "pydantic_user_profile",
        # What pydantic v2's ``model_json_schema()`` emits for a model with a nested model, an enum,
        # ``Optional[...] = None`` fields and a list, as the openai client sends it for ``.parse``.
        # xgrammar 0.2.8 compiles it with a warning: it ignores minLength/maxLength beside a pattern
        # (username) or a format (url), so its output may break those bounds; llguidance enforces them.
        {
            "$defs": {
                "Role": {"enum": ["admin", "editor", "viewer"], "title": "Role", "type": "string"},
                "SocialLink": {
                    "properties": {
                        "platform": {"title": "Platform", "type": "string"},
                        "url": {"format": "uri", "maxLength": 2083, "minLength": 1, "title": "Url", "type": "string"},
                    },
                    "required": ["platform", "url"],
                    "title": "SocialLink",
                    "type": "object",
                    "additionalProperties": False,
                },
            },
            "properties": {
                "username": {
                    "maxLength": 32,
                    "minLength": 3,
                    "pattern": "^[a-z0-9_]+$",
                    "title": "Username",
                    "type": "string",
                },
                "display_name": {
                    "anyOf": [{"type": "string"}, {"type": "null"}],
                    "default": None,
                    "title": "Display Name",
                },
                "age": {
                    "anyOf": [{"maximum": 130, "minimum": 13, "type": "integer"}, {"type": "null"}],
                    "default": None,
                    "title": "Age",
                },
                "role": {"$ref": "#/$defs/Role"},
                "links": {"items": {"$ref": "#/$defs/SocialLink"}, "title": "Links", "type": "array"},
                "verified": {"default": False, "title": "Verified", "type": "boolean"},
            },
            "required": ["username", "display_name", "age", "role", "links", "verified"],
            "title": "UserProfile",
            "type": "object",
            "additionalProperties": False,
        },
    ),
    (
        "openai_math_reasoning",
        # The "chain of thought" example of OpenAI's structured outputs guide.
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "steps": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"explanation": {"type": "string"}, "output": {"type": "string"}},
                        "required": ["explanation", "output"],
                        "additionalProperties": False,
                    },
                },
                "final_answer": {"type": "string"},
            },
            "required": ["steps", "final_answer"],
            "additionalProperties": False,
        },
    ),
    (
        "feature_flags_multitype",
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "environment": {"type": "string", "enum": ["dev", "staging", "prod"]},
                "flags": {
                    "type": "array",
                    "maxItems": 8,
                    "items": {
                        "type": "object",
                        "properties": {
                            "key": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,40}$"},
                            "value": {"type": ["boolean", "integer", "string"]},
                            "rollout_percent": {"type": "integer", "minimum": 0, "maximum": 100},
                        },
                        "required": ["key", "value"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["environment", "flags"],
            "additionalProperties": False,
        },
    ),
    (
        "inventory_draft07",
        # draft-07 style: ``definitions`` and ``#/definitions/...`` references.
        {
            "$schema": _DRAFT_07,
            "title": "Warehouse inventory",
            "type": "object",
            "definitions": {
                "bin": {"type": "string", "pattern": "^[A-Z][0-9]{2}-[0-9]{2}$"},
                "item": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z0-9]{8}$"},
                        "description": {"type": "string", "maxLength": 80},
                        "quantity": {"type": "integer", "minimum": 0, "maximum": 100000},
                        "bin": {"$ref": "#/definitions/bin"},
                        "reorder": {"type": "boolean"},
                    },
                    "required": ["sku", "quantity", "bin"],
                    "additionalProperties": False,
                },
            },
            "properties": {
                "warehouse": {"type": "string", "enum": ["SEA1", "PDX2", "SFO3"]},
                "counted_at": {"type": "string", "format": "date-time"},
                "items": {"type": "array", "items": {"$ref": "#/definitions/item"}, "minItems": 1, "maxItems": 25},
            },
            "required": ["warehouse", "counted_at", "items"],
            "additionalProperties": False,
        },
    ),
    (
        "support_ticket_triage",
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "ticket_id": {"type": "string", "pattern": "^TCK-[0-9]{5}$"},
                "priority": {"type": "string", "enum": ["low", "normal", "high", "critical"]},
                "product_area": {"type": "string", "enum": ["api", "dashboard", "billing", "mobile", "integrations"]},
                "customer_tier": {"type": "string", "enum": ["free", "pro", "enterprise"]},
                "summary": {"type": "string", "minLength": 10, "maxLength": 200},
                "suggested_reply": {"type": "string", "maxLength": 1000},
                "needs_escalation": {"type": "boolean"},
                "sla_hours": {"type": "integer", "minimum": 1, "maximum": 72},
            },
            "required": ["ticket_id", "priority", "product_area", "summary", "needs_escalation"],
            "additionalProperties": False,
        },
    ),
    (
        "tool_send_email",
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "to": {"type": "array", "items": {"type": "string", "format": "email"}, "minItems": 1, "maxItems": 10},
                "cc": {"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 10},
                "subject": {"type": "string", "minLength": 1, "maxLength": 150},
                "body": {"type": "string", "minLength": 1, "maxLength": 5000},
                "importance": {"type": "string", "enum": ["low", "normal", "high"]},
                "send_at": {"anyOf": [{"type": "string", "format": "date-time"}, {"type": "null"}]},
            },
            "required": ["to", "subject", "body"],
            "additionalProperties": False,
        },
    ),
    (
        "bank_transaction",
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "transaction_id": {"type": "string", "format": "uuid"},
                "booked_at": {"type": "string", "format": "date-time"},
                "amount": {"type": "number", "minimum": -1000000, "maximum": 1000000},
                "currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "counterparty": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{11,30}$"},
                    },
                    "required": ["name"],
                    "additionalProperties": False,
                },
                "category": {
                    "type": "string",
                    "enum": [
                        "groceries",
                        "rent",
                        "salary",
                        "utilities",
                        "transport",
                        "dining",
                        "entertainment",
                        "transfer",
                        "other",
                    ],
                },
                "is_recurring": {"type": "boolean"},
            },
            "required": ["transaction_id", "booked_at", "amount", "currency", "category"],
            "additionalProperties": False,
        },
    ),
]


def _ref_bomb(levels: int) -> Schema:
    """Each level holds two references to the next: 2**levels nodes once the references are inlined."""
    defs = {
        f"d{i}": {
            "type": "object",
            "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}, "b": {"$ref": f"#/$defs/d{i + 1}"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        }
        for i in range(levels)
    }
    defs[f"d{levels}"] = {"type": "integer"}
    return {"$schema": _DRAFT_2020, "$ref": "#/$defs/d0", "$defs": defs}


def _large_schema(target_bytes: int) -> Schema:
    """An object with thousands of optional properties (each a small object with a pattern and an enum)."""
    properties: dict[str, Schema] = {}
    i = 0
    size = 0
    while size < target_bytes:
        prop = {
            "type": "object",
            "description": f"Configuration block number {i} of the generated schema.",
            "properties": {
                "mode": {"type": "string", "enum": [f"m{i}a", f"m{i}b", f"m{i}c"]},
                "code": {"type": "string", "pattern": f"^X{i}-[0-9]{{4}}$"},
                "weight": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["mode"],
            "additionalProperties": False,
        }
        properties[f"block_{i:05d}"] = prop
        size += 360  # about the serialized size of one property (the tests check the total)
        i += 1
    return {"$schema": _DRAFT_2020, "type": "object", "properties": properties, "additionalProperties": False}


# Schemas a server must refuse (400) in bounded time, or compile under its caps: never a 500 or a stall.
HOSTILE_SCHEMAS: list[tuple[str, Schema]] = [
    # What each backend does with them (bench/grammar_backends.py --hostile): bench/RESULTS.md. Neither
    # inlines references, and neither sees that ref_recursion_unsatisfiable has no finite instance.
    ("ref_bomb_exponential", _ref_bomb(48)),  # 2**48 nodes if a compiler inlines references
    (
        "ref_recursion_unsatisfiable",  # a required self-reference: no finite instance exists
        {
            "$schema": _DRAFT_2020,
            "$ref": "#/$defs/node",
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {"child": {"$ref": "#/$defs/node"}},
                    "required": ["child"],
                    "additionalProperties": False,
                }
            },
        },
    ),
    (
        "enum_10k",
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {
                "code": {"type": "string", "enum": [f"code_{i:05d}_{(i * 7919) % 10007:05d}" for i in range(10_000)]}
            },
            "required": ["code"],
        },
    ),
    ("large_1mb", _large_schema(1_000_000)),
    (
        "invalid_schema",  # "type" is not a JSON type, and minItems is negative
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {"name": {"type": "strnig"}, "tags": {"type": "array", "minItems": -1}},
        },
    ),
    (
        "invalid_regex",  # an unbalanced group
        {
            "$schema": _DRAFT_2020,
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "^([A-Z]{3}-[0-9]+$"}},
            "required": ["code"],
        },
    ),
]
