/* profile_analyzer.loaders._scan: one slice of a Chrome-trace event array (``[{...}, {...}]``) straight into
 * the columns the loader builds, without a Python object per event.
 *
 * It is the compiled twin of decoding the slice with msgspec into ``_slicer.Event`` and reading the fields in
 * ``_columns._columnarise``: for every slice it accepts, the columns are the ones that path gives (the tests
 * compare the two on every trace in the test data). It accepts only the plain case and answers None for
 * anything else (a string with an escape where a value is read, a pid that is a string, a dur that is a string,
 * a field of a type the Event struct would refuse, JSON it cannot vouch for, a cut inside a nested value...);
 * the caller then decodes the slice with msgspec, which gives the values or the error message.
 *
 * scan(buf, names, cats, ttypes, flow_cats, want_ttype, want_args) -> None | tuple:
 *   buf        the slice, '[' ... ']' with only blanks after
 *   names, cats, ttypes   per column: (values list, str -> id dict, bytes|None -> id dict); a value not seen
 *              before gets the next id (first-seen order, as _columns._Interner numbers them)
 *   flow_cats  frozenset of str: the flow categories kept
 * returns (n_events, x_count, pid i64, tid i64, ts_joined, dur f64, dur_kind u8, name i32, cat i32, ttype i32,
 *          stream i64, corr i64, meta_spans i64, flow_cat list, flow_ph bytes, flow_id list, flow_ts_joined)
 *   with the arrays as bytes; ts_joined: every ts's raw JSON text followed by '\n' ('' when absent);
 *   dur_kind: 0 a float, 1 an integer, 2 absent or null, 3 an integer past 2**53 (dur holds its int64 bits); meta_spans: (start, end) of each 'M' event.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

typedef const unsigned char *cp;

typedef struct {
    char *p;
    Py_ssize_t n, cap;
} Vec;

static int vec_reserve(Vec *v, Py_ssize_t extra) {
    if (v->n + extra <= v->cap) return 0;
    Py_ssize_t cap = v->cap ? v->cap : 4096;
    while (cap < v->n + extra) cap *= 2;
    char *p = PyMem_Realloc(v->p, (size_t)cap);
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    v->p = p;
    v->cap = cap;
    return 0;
}

static inline int vec_put(Vec *v, const void *src, Py_ssize_t k) {
    if (vec_reserve(v, k) < 0) return -1;
    memcpy(v->p + v->n, src, (size_t)k);
    v->n += k;
    return 0;
}

static PyObject *vec_bytes(Vec *v) { return PyBytes_FromStringAndSize(v->p ? v->p : "", v->n); }

static void vec_free(Vec *v) {
    PyMem_Free(v->p);
    v->p = NULL;
    v->n = v->cap = 0;
}

/* ---- JSON lexing: each returns the position after the token, or NULL when it cannot vouch for it ---- */

static inline cp ws(cp p, cp e) {
    while (p < e && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t')) p++;
    return p;
}

/* A string at p (*p == '"'): its end; *esc set when it holds a backslash escape. Control bytes are invalid JSON. */
static cp str_end(cp p, cp e, int *esc) {
    p++;
    *esc = 0;
    while (p < e) {
        unsigned char c = *p;
        if (c == '"') return p + 1;
        if (c == '\\') {
            *esc = 1;
            if (p + 1 >= e) return NULL;
            unsigned char d = p[1];
            if (d == 'u') {
                if (p + 6 > e) return NULL;
                for (int k = 2; k < 6; k++) {
                    unsigned char h = p[k];
                    if (!((h >= '0' && h <= '9') || (h >= 'a' && h <= 'f') || (h >= 'A' && h <= 'F'))) return NULL;
                }
                p += 6;
                continue;
            }
            if (!strchr("\"\\/bfnrt", d) || d == 0) return NULL;
            p += 2;
            continue;
        }
        if (c < 0x20) return NULL;
        p++;
    }
    return NULL;
}

/* A JSON number at p: its end; *is_int when it has no fraction or exponent. */
static cp num_end(cp p, cp e, int *is_int) {
    cp s = p;
    if (p < e && *p == '-') p++;
    if (p >= e) return NULL;
    if (*p == '0') {
        p++;
    } else if (*p >= '1' && *p <= '9') {
        while (p < e && *p >= '0' && *p <= '9') p++;
    } else {
        return NULL;
    }
    *is_int = 1;
    if (p < e && *p == '.') {
        p++;
        cp d = p;
        while (p < e && *p >= '0' && *p <= '9') p++;
        if (p == d) return NULL;
        *is_int = 0;
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < e && (*p == '+' || *p == '-')) p++;
        cp d = p;
        while (p < e && *p >= '0' && *p <= '9') p++;
        if (p == d) return NULL;
        *is_int = 0;
    }
    (void)s;
    return p;
}

static cp lit_end(cp p, cp e, const char *lit) {
    size_t k = strlen(lit);
    if ((size_t)(e - p) < k || memcmp(p, lit, k) != 0) return NULL;
    return p + k;
}

#define MAX_DEPTH 256

/* Any JSON value at p (after blanks): its end. Nesting is walked without recursion. */
static cp skip_value(cp p, cp e) {
    char stack[MAX_DEPTH];
    int depth = 0, esc, is_int;
    for (;;) {
        p = ws(p, e);
        if (p >= e) return NULL;
        unsigned char c = *p;
        if (c == '{' || c == '[') {
            if (depth >= MAX_DEPTH) return NULL;
            stack[depth++] = (char)c;
            p = ws(p + 1, e);
            if (p >= e) return NULL;
            if ((c == '{' && *p == '}') || (c == '[' && *p == ']')) {
                depth--;
                p++;
                goto after_value;
            }
            if (c == '{') {
                if (*p != '"' || !(p = str_end(p, e, &esc))) return NULL;
                p = ws(p, e);
                if (p >= e || *p != ':') return NULL;
                p++;
            }
            continue;
        }
        if (c == '"') p = str_end(p, e, &esc);
        else if (c == 't') p = lit_end(p, e, "true");
        else if (c == 'f') p = lit_end(p, e, "false");
        else if (c == 'n') p = lit_end(p, e, "null");
        else p = num_end(p, e, &is_int);
        if (!p) return NULL;
    after_value:
        for (;;) {
            if (depth == 0) return p;
            p = ws(p, e);
            if (p >= e) return NULL;
            char top = stack[depth - 1];
            if (*p == ',') {
                p = ws(p + 1, e);
                if (top == '{') {
                    if (p >= e || *p != '"' || !(p = str_end(p, e, &esc))) return NULL;
                    p = ws(p, e);
                    if (p >= e || *p != ':') return NULL;
                    p++;
                }
                break; /* the next value */
            }
            if ((top == '{' && *p == '}') || (top == '[' && *p == ']')) {
                depth--;
                p++;
                continue;
            }
            return NULL;
        }
    }
}

/* ---- values read from an event ---- */

enum { T_ABSENT = 0, T_STR, T_INT, T_FLOAT, T_NULL, T_OTHER };

typedef struct {
    int type;
    cp a, b; /* the value's text; for a string without its quotes */
    int esc;
} Val;

/* One value at p into v; returns its end. */
static cp read_value(cp p, cp e, Val *v) {
    int is_int;
    p = ws(p, e);
    if (p >= e) return NULL;
    v->a = p;
    v->esc = 0;
    if (*p == '"') {
        cp q = str_end(p, e, &v->esc);
        if (!q) return NULL;
        v->type = T_STR;
        v->a = p + 1;
        v->b = q - 1;
        return q;
    }
    if (*p == 'n') {
        cp q = lit_end(p, e, "null");
        if (!q) return NULL;
        v->type = T_NULL;
        v->b = q;
        return q;
    }
    if (*p == '-' || (*p >= '0' && *p <= '9')) {
        cp q = num_end(p, e, &is_int);
        if (!q) return NULL;
        v->type = is_int ? T_INT : T_FLOAT;
        v->b = q;
        return q;
    }
    cp q = skip_value(p, e);
    if (!q) return NULL;
    v->type = T_OTHER;
    v->b = q;
    return q;
}

static int key_is(cp a, cp b, const char *k) {
    size_t n = strlen(k);
    return (size_t)(b - a) == n && memcmp(a, k, n) == 0;
}

/* A JSON integer of at most 18 digits (so int64 holds it and a double holds it to 2**53 when asked) */
static int int_value(const Val *v, int64_t *out) {
    cp p = v->a;
    int neg = 0;
    if (*p == '-') {
        neg = 1;
        p++;
    }
    if (v->b - p > 18) return -1;
    int64_t x = 0;
    for (; p < v->b; p++) x = x * 10 + (*p - '0');
    *out = neg ? -x : x;
    return 0;
}

/* int | str | None, as the Event struct's pid/tid/id and the Args struct's stream fields accept */
static inline int is_int_str_none(const Val *v) {
    return v->type == T_ABSENT || v->type == T_INT || v->type == T_STR || v->type == T_NULL;
}

static inline int is_str_none(const Val *v) {
    return v->type == T_ABSENT || v->type == T_STR || v->type == T_NULL;
}

#define CACHE_SLOTS 4096 /* a power of two */

typedef struct {
    uint64_t hash;
    cp p;
    int32_t len, id; /* id -1: an empty slot */
} Slot;

typedef struct {
    PyObject *values, *ids; /* list of str|None, dict bytes|None -> id */
    Slot *cache;            /* this call's texts already looked up (they point into the slice) */
    int32_t none_id, used;  /* the id of None once looked up (-1 before) */
} Interner;

static inline uint64_t fnv1a(cp p, Py_ssize_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (Py_ssize_t k = 0; k < n; k++) h = (h ^ p[k]) * 1099511628211ULL;
    return h;
}

#define BAIL 1  /* not a plain slice: the caller decodes it with msgspec */
#define ERR (-1) /* a Python exception is set */

/* A UTF-8 text as str; NULL with no exception set when it is not valid UTF-8 (the slice is then not ours) */
static PyObject *utf8(cp a, cp b) {
    PyObject *s = PyUnicode_DecodeUTF8((const char *)a, b - a, NULL);
    if (!s && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) PyErr_Clear();
    return s;
}

/* The id (first-seen order in this interner) of a string value without escapes, or of None (absent or null);
 * ERR, or -BAIL - 1 for text that is not UTF-8. */
static int32_t intern_py(Interner *in, const Val *v);

static int32_t intern(Interner *in, const Val *v) {
    if (v->type != T_STR) {
        if (in->none_id < 0) in->none_id = intern_py(in, v);
        return in->none_id;
    }
    Py_ssize_t n = v->b - v->a;
    uint64_t h = fnv1a(v->a, n);
    size_t k = (size_t)h & (CACHE_SLOTS - 1);
    for (;;) {
        Slot *sl = &in->cache[k];
        if (sl->id < 0) break;
        if (sl->hash == h && sl->len == n && memcmp(sl->p, v->a, (size_t)n) == 0) return sl->id;
        k = (k + 1) & (CACHE_SLOTS - 1);
    }
    int32_t id = intern_py(in, v);
    if (id >= 0 && in->used < CACHE_SLOTS / 2 && n < INT32_MAX) {
        in->cache[k] = (Slot){h, v->a, (int32_t)n, id};
        in->used++;
    }
    return id;
}

static int32_t intern_py(Interner *in, const Val *v) {
    PyObject *key, *id, *s;
    if (v->type == T_STR) key = PyBytes_FromStringAndSize((const char *)v->a, v->b - v->a);
    else key = Py_NewRef(Py_None);
    if (!key) return ERR;
    id = PyDict_GetItemWithError(in->ids, key); /* borrowed */
    if (id) {
        Py_DECREF(key);
        return (int32_t)PyLong_AsLong(id);
    }
    if (PyErr_Occurred()) goto fail;
    if (v->type == T_STR) {
        if (!(s = utf8(v->a, v->b))) {
            Py_DECREF(key);
            return PyErr_Occurred() ? ERR : -BAIL - 1;
        }
    } else {
        s = Py_NewRef(Py_None);
    }
    Py_ssize_t n = PyList_GET_SIZE(in->values);
    id = PyLong_FromSsize_t(n);
    int rc = (!id || PyList_Append(in->values, s) < 0 || PyDict_SetItem(in->ids, key, id) < 0) ? -1 : 0;
    Py_XDECREF(id);
    Py_DECREF(s);
    Py_DECREF(key);
    return rc < 0 ? ERR : (int32_t)n;
fail:
    Py_DECREF(key);
    return ERR;
}


typedef struct {
    Vec pid, tid, ts, dur, dkind, name, cat, ttype, stream, corr, meta, fph, fts;
    PyObject *fcat, *fid; /* lists */
    Py_ssize_t n_events, n_x;
} Out;

/* An object's key at p (a string without escapes) and its ':': [*ka, *kb) is the key's text; returns the position
 * after the ':', NULL when it is not such a key. */
static cp read_key(cp p, cp e, cp *ka, cp *kb) {
    int esc;
    if (p >= e || *p != '"') return NULL;
    cp q = str_end(p, e, &esc);
    if (!q || esc) return NULL;
    *ka = p + 1;
    *kb = q - 1;
    p = ws(q, e);
    if (p >= e || *p != ':') return NULL;
    return p + 1;
}

/* The args object of an event: type checks of every Args field, the three the columns use read. */
static int read_args(cp *pp, cp e, Val *ttype, Val *stream, Val *corr) {
    cp p = ws(*pp, e);
    Val v;
    if (p >= e || *p != '{') return BAIL;
    p = ws(p + 1, e);
    if (p < e && *p == '}') {
        *pp = p + 1;
        return 0;
    }
    for (;;) {
        cp ka, kb;
        if (!(p = read_key(p, e, &ka, &kb)) || !(p = read_value(p, e, &v))) return BAIL;
        switch (kb - ka) {
        case 4:
            if (key_is(ka, kb, "name") && !is_str_none(&v)) return BAIL;
            if (key_is(ka, kb, "rank") && !is_int_str_none(&v)) return BAIL;
            break;
        case 6:
            if (key_is(ka, kb, "labels") && !is_str_none(&v)) return BAIL;
            if (key_is(ka, kb, "stream")) {
                if (stream->type != T_ABSENT) return BAIL; /* a repeated key */
                *stream = v;
            }
            break;
        case 9:
            if (key_is(ka, kb, "Task Type")) {
                if (ttype->type != T_ABSENT) return BAIL;
                *ttype = v;
            } else if (key_is(ka, kb, "Stream Id") && !is_int_str_none(&v)) return BAIL;
            break;
        case 11:
            if (key_is(ka, kb, "correlation")) {
                if (corr->type != T_ABSENT) return BAIL;
                *corr = v;
            }
            break;
        case 16:
            if (key_is(ka, kb, "Physic Stream Id") && !is_int_str_none(&v)) return BAIL;
            break;
        }
        p = ws(p, e);
        if (p >= e) return BAIL;
        if (*p == '}') {
            *pp = p + 1;
            break;
        }
        if (*p != ',') return BAIL;
        p = ws(p + 1, e);
    }
    if (!is_str_none(ttype) || (ttype->type == T_STR && ttype->esc)) return BAIL;
    /* stream/correlation: int or null here (a string is read by the Python path) */
    if (!(stream->type == T_ABSENT || stream->type == T_INT || stream->type == T_NULL)) return BAIL;
    if (!(corr->type == T_ABSENT || corr->type == T_INT || corr->type == T_NULL)) return BAIL;
    return 0;
}

/* A decimal without exponent, at most 15 significant digits and 22 decimals, as the correctly rounded double:
 * the digits as an integer and the power of ten are both exact doubles, and one IEEE division rounds once
 * (Clinger's fast path). 0 when the text is not of that form (the caller then uses PyOS_string_to_double). */
static const double POW10[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,  1e8,  1e9,  1e10, 1e11,
                               1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

static int fast_double(const Val *v, double *out) {
    cp p = v->a;
    int neg = 0, digits = 0, frac = -1;
    uint64_t m = 0;
    if (*p == '-') {
        neg = 1;
        p++;
    }
    for (; p < v->b; p++) {
        unsigned char c = *p;
        if (c == '.') {
            frac = 0;
            continue;
        }
        if (c < '0' || c > '9') return 0; /* an exponent */
        if (m || c != '0') digits++;
        m = m * 10 + (uint64_t)(c - '0');
        if (frac >= 0) frac++;
        if (digits > 15) return 0;
    }
    if (frac < 0) frac = 0;
    if (frac > 22) return 0;
    double d = (double)m / POW10[frac];
    *out = neg ? -d : d;
    return 1;
}

static int put_i64(Vec *v, int64_t x) { return vec_put(v, &x, 8); }
static int put_i32(Vec *v, int32_t x) { return vec_put(v, &x, 4); }

static int opt_int(const Val *v, int64_t *out) {
    if (v->type != T_INT) {
        *out = -1;
        return 0;
    }
    return int_value(v, out);
}

/* One event object at p ('{'). */
static int read_event(cp base, cp *pp, cp e, Out *o, Interner *names, Interner *cats, Interner *ttypes, PyObject *flow_cats,
                      int want_ttype, int want_args) {
    cp start = *pp, p = ws(*pp + 1, e);
    Val ph = {0}, name = {0}, pid = {0}, tid = {0}, ts = {0}, dur = {0}, cat = {0}, id = {0};
    Val ttype = {0}, stream = {0}, corr = {0};
    int have_args = 0;
    if (p < e && *p == '}') {
        p++;
        goto done;
    }
    for (;;) {
        cp ka, kb;
        if (!(p = read_key(p, e, &ka, &kb))) return BAIL;
        Val *slot = NULL;
        switch (kb - ka) {
        case 2:
            if (key_is(ka, kb, "ph")) slot = &ph;
            else if (key_is(ka, kb, "ts")) slot = &ts;
            else if (key_is(ka, kb, "id")) slot = &id;
            break;
        case 3:
            if (key_is(ka, kb, "pid")) slot = &pid;
            else if (key_is(ka, kb, "tid")) slot = &tid;
            else if (key_is(ka, kb, "dur")) slot = &dur;
            else if (key_is(ka, kb, "cat")) slot = &cat;
            break;
        case 4:
            if (key_is(ka, kb, "name")) slot = &name;
            else if (key_is(ka, kb, "args")) {
                if (have_args) return BAIL;
                have_args = 1;
                cp q = ws(p, e);
                if (q < e && *q == 'n') { /* "args": null: every field None */
                    if (!(p = lit_end(q, e, "null"))) return BAIL;
                } else {
                    p = q;
                    int rc = read_args(&p, e, &ttype, &stream, &corr);
                    if (rc) return rc;
                }
                goto next;
            }
            break;
        }
        if (slot) {
            if (slot->type != T_ABSENT) return BAIL; /* a repeated key */
            if (!(p = read_value(p, e, slot))) return BAIL;
        } else if (!(p = skip_value(p, e))) {
            return BAIL;
        }
    next:
        p = ws(p, e);
        if (p >= e) return BAIL;
        if (*p == '}') {
            p++;
            break;
        }
        if (*p != ',') return BAIL;
        p = ws(p + 1, e);
    }
done:
    *pp = p;
    /* the Event struct's types: what it would refuse, or what needs the Python path, is not ours */
    if (!(ph.type == T_ABSENT || (ph.type == T_STR && !ph.esc))) return BAIL;
    if (!(name.type == T_ABSENT || (name.type == T_STR && !name.esc))) return BAIL;
    if (!(pid.type == T_ABSENT || pid.type == T_INT) || !(tid.type == T_ABSENT || tid.type == T_INT)) return BAIL;
    if (!(dur.type == T_ABSENT || dur.type == T_INT || dur.type == T_FLOAT || dur.type == T_NULL)) return BAIL;
    if (!(cat.type == T_ABSENT || cat.type == T_NULL || (cat.type == T_STR && !cat.esc))) return BAIL;
    if (!is_int_str_none(&id) || (id.type == T_STR && id.esc)) return BAIL;
    /* ts: a number, a string without escapes or null (its raw text); anything else is the Python path's */
    if (!(ts.type == T_ABSENT || ts.type == T_INT || ts.type == T_FLOAT || ts.type == T_NULL ||
          (ts.type == T_STR && !ts.esc)))
        return BAIL;
    o->n_events++;
    Py_ssize_t phn = ph.type == T_STR ? ph.b - ph.a : 0;
    unsigned char ph0 = phn == 1 ? ph.a[0] : 0;
    cp ts_a = ts.type == T_STR ? ts.a - 1 : ts.a, ts_b = ts.type == T_STR ? ts.b + 1 : ts.b; /* raw, with quotes */
    if (ph0 == 'X') {
        int64_t v;
        o->n_x++;
        if (pid.type == T_ABSENT) v = 0;
        else if (int_value(&pid, &v) < 0) return BAIL;
        if (put_i64(&o->pid, v) < 0) return ERR;
        if (tid.type == T_ABSENT) v = 0;
        else if (int_value(&tid, &v) < 0) return BAIL;
        if (put_i64(&o->tid, v) < 0) return ERR;
        if (ts.type != T_ABSENT && vec_put(&o->ts, ts_a, ts_b - ts_a) < 0) return ERR;
        if (vec_put(&o->ts, "\n", 1) < 0) return ERR;
        double d = 0;
        unsigned char kind = 2;
        if (dur.type == T_INT) {
            int64_t iv;
            if (int_value(&dur, &iv) < 0) return BAIL;
            if (iv > (1LL << 53) || iv < -(1LL << 53)) { /* beyond a double's integers: the int64 bits, kind 3 */
                memcpy(&d, &iv, 8);
                kind = 3;
            } else {
                d = (double)iv;
                kind = 1;
            }
        } else if (dur.type == T_FLOAT && fast_double(&dur, &d)) {
            kind = 0;
        } else if (dur.type == T_FLOAT) {
            char buf[64];
            Py_ssize_t k = dur.b - dur.a;
            if (k >= (Py_ssize_t)sizeof(buf)) return BAIL;
            memcpy(buf, dur.a, (size_t)k);
            buf[k] = 0;
            char *end;
            d = PyOS_string_to_double(buf, &end, NULL); /* correctly rounded, locale-independent */
            if (d == -1.0 && PyErr_Occurred()) return ERR;
            if (end != buf + k || !isfinite(d)) return BAIL; /* msgspec refuses a number out of range */
            kind = 0;
        }
        if (vec_put(&o->dur, &d, 8) < 0 || vec_put(&o->dkind, &kind, 1) < 0) return ERR;
        int32_t i;
        Val empty = {T_STR, (cp) "", (cp) "", 0};
        if ((i = intern(names, name.type == T_ABSENT ? &empty : &name)) < 0) return i == ERR ? ERR : BAIL;
        if (put_i32(&o->name, i) < 0) return ERR;
        if ((i = intern(cats, &cat)) < 0) return i == ERR ? ERR : BAIL;
        if (put_i32(&o->cat, i) < 0) return ERR;
        if (want_ttype) {
            if ((i = intern(ttypes, &ttype)) < 0) return i == ERR ? ERR : BAIL;
            if (put_i32(&o->ttype, i) < 0) return ERR;
        }
        if (want_args) {
            if (opt_int(&stream, &v) < 0) return BAIL;
            if (put_i64(&o->stream, v) < 0) return ERR;
            if (opt_int(&corr, &v) < 0) return BAIL;
            if (put_i64(&o->corr, v) < 0) return ERR;
        }
    } else if (ph0 == 'M') {
        if (put_i64(&o->meta, (int64_t)(start - base)) < 0 || put_i64(&o->meta, (int64_t)(p - base)) < 0) return ERR;
    } else if ((ph0 == 's' || ph0 == 'f' || ph0 == 't') && cat.type == T_STR && ts.type != T_ABSENT) {
        PyObject *c = utf8(cat.a, cat.b);
        if (!c) return PyErr_Occurred() ? ERR : BAIL;
        int in = PySet_Contains(flow_cats, c);
        if (in < 0) {
            Py_DECREF(c);
            return ERR;
        }
        if (in) {
            PyObject *idv;
            if (id.type == T_INT) {
                int64_t iv;
                if (int_value(&id, &iv) == 0) {
                    idv = PyLong_FromLongLong(iv);
                } else { /* more than 18 digits: Python's int of the text */
                    char buf[400];
                    Py_ssize_t k = id.b - id.a;
                    if (k >= (Py_ssize_t)sizeof(buf)) {
                        Py_DECREF(c);
                        return BAIL;
                    }
                    memcpy(buf, id.a, (size_t)k);
                    buf[k] = 0;
                    idv = PyLong_FromString(buf, NULL, 10);
                }
            } else if (id.type == T_STR) {
                if (!(idv = utf8(id.a, id.b)) && !PyErr_Occurred()) {
                    Py_DECREF(c);
                    return BAIL;
                }
            } else {
                idv = Py_NewRef(Py_None);
            }
            if (!idv || PyList_Append(o->fcat, c) < 0 || PyList_Append(o->fid, idv) < 0 ||
                vec_put(&o->fph, &ph0, 1) < 0 || vec_put(&o->fts, ts_a, ts_b - ts_a) < 0 ||
                vec_put(&o->fts, "\n", 1) < 0) {
                Py_XDECREF(idv);
                Py_DECREF(c);
                return ERR;
            }
            Py_DECREF(idv);
        }
        Py_DECREF(c);
    }
    return 0;
}

static int get_interner(PyObject *t, Interner *in) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 2 || !PyList_Check(PyTuple_GET_ITEM(t, 0)) ||
        !PyDict_Check(PyTuple_GET_ITEM(t, 1))) {
        PyErr_SetString(PyExc_TypeError, "an interner is (values list, bytes|None -> id dict)");
        return -1;
    }
    in->values = PyTuple_GET_ITEM(t, 0);
    in->ids = PyTuple_GET_ITEM(t, 1);
    in->none_id = -1;
    in->used = 0;
    in->cache = PyMem_Malloc(CACHE_SLOTS * sizeof(Slot));
    if (!in->cache) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t k = 0; k < CACHE_SLOTS; k++) in->cache[k].id = -1;
    return 0;
}

/* The slice is valid UTF-8 (as msgspec requires of every string, read or skipped): ASCII is checked eight bytes
 * at a time; a multi-byte sequence must be well formed, not overlong, not a surrogate, at most U+10FFFF. */
static int utf8_ok(cp p, cp e) {
    while (p < e) {
        if (e - p >= 8) {
            uint64_t w;
            memcpy(&w, p, 8);
            if (!(w & 0x8080808080808080ULL)) {
                p += 8;
                continue;
            }
        }
        unsigned char c = *p;
        if (c < 0x80) {
            p++;
            continue;
        }
        int n;
        uint32_t cpt;
        if (c >= 0xC2 && c <= 0xDF) {
            n = 1;
            cpt = c & 0x1F;
        } else if (c >= 0xE0 && c <= 0xEF) {
            n = 2;
            cpt = c & 0x0F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            n = 3;
            cpt = c & 0x07;
        } else {
            return 0;
        }
        if (e - p <= n) return 0;
        for (int k = 1; k <= n; k++) {
            if ((p[k] & 0xC0) != 0x80) return 0;
            cpt = (cpt << 6) | (p[k] & 0x3F);
        }
        if ((n == 2 && (cpt < 0x800 || (cpt >= 0xD800 && cpt <= 0xDFFF))) || (n == 3 && (cpt < 0x10000 || cpt > 0x10FFFF)))
            return 0;
        p += n + 1;
    }
    return 1;
}

static PyObject *scan(PyObject *self, PyObject *args) {
    Py_buffer view;
    PyObject *tn, *tc, *tt, *flow_cats, *result = NULL;
    int want_ttype, want_args;
    Interner names = {0}, cats = {0}, ttypes = {0};
    if (!PyArg_ParseTuple(args, "y*OOOOpp", &view, &tn, &tc, &tt, &flow_cats, &want_ttype, &want_args)) return NULL;
    Out o;
    memset(&o, 0, sizeof o);
    if (get_interner(tn, &names) < 0 || get_interner(tc, &cats) < 0 || get_interner(tt, &ttypes) < 0) goto out;
    if (!PyAnySet_Check(flow_cats)) {
        PyErr_SetString(PyExc_TypeError, "flow_cats must be a set");
        goto out;
    }
    if (!(o.fcat = PyList_New(0)) || !(o.fid = PyList_New(0))) goto out;
    cp base = (cp)view.buf, e = base + view.len, p = ws(base, e);
    int rc = BAIL;
    if (p >= e || *p != '[' || !utf8_ok(base, e)) goto bail;
    p = ws(p + 1, e);
    if (p < e && *p == ']') {
        p++;
    } else {
        for (;;) {
            if (p >= e || *p != '{') goto bail;
            rc = read_event(base, &p, e, &o, &names, &cats, &ttypes, flow_cats, want_ttype, want_args);
            if (rc == ERR) goto out;
            if (rc == BAIL) goto bail;
            p = ws(p, e);
            if (p >= e) goto bail;
            if (*p == ']') {
                p++;
                break;
            }
            if (*p != ',') goto bail;
            p = ws(p + 1, e);
        }
    }
    if (ws(p, e) != e) goto bail;
    result = Py_BuildValue("(nnNNNNNNNNNNNNNNN)", o.n_events, o.n_x, vec_bytes(&o.pid), vec_bytes(&o.tid),
                           vec_bytes(&o.ts), vec_bytes(&o.dur), vec_bytes(&o.dkind), vec_bytes(&o.name),
                           vec_bytes(&o.cat), vec_bytes(&o.ttype), vec_bytes(&o.stream), vec_bytes(&o.corr),
                           vec_bytes(&o.meta), Py_NewRef(o.fcat), vec_bytes(&o.fph), Py_NewRef(o.fid),
                           vec_bytes(&o.fts));
    goto out;
bail:
    result = Py_NewRef(Py_None);
out:
    Py_XDECREF(o.fcat);
    Py_XDECREF(o.fid);
    Vec *vs[] = {&o.pid, &o.tid, &o.ts, &o.dur, &o.dkind, &o.name, &o.cat, &o.ttype, &o.stream, &o.corr, &o.meta,
                 &o.fph, &o.fts};
    for (size_t k = 0; k < sizeof vs / sizeof vs[0]; k++) vec_free(vs[k]);
    PyMem_Free(names.cache);
    PyMem_Free(cats.cache);
    PyMem_Free(ttypes.cache);
    PyBuffer_Release(&view);
    return result;
}

/* ---- kernel_details.csv: the first (Type, core) of each Name, and the row count ----
 *
 * kernel_names(data, i_name, i_type, i_core) -> (types dict, cores dict, rows) | None, for the rows after the
 * header line (data starts at the first data row). The csv module's reading of the same rows (excel dialect) is
 * the reference; rows it would read in a way this does not follow are declined (None): a quote inside an
 * unquoted field, anything but a delimiter or line end after a closing quote, a quoted Name/Type/core field with
 * a doubled quote, a NUL byte, a lone '\r', invalid UTF-8. Quoted fields (with commas and line breaks) are
 * otherwise skipped or read as csv reads them. */

typedef struct {
    cp a, b;
} Span;

static PyObject *kernel_names(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t i_name, i_type, i_core;
    PyObject *types = NULL, *cores = NULL, *result = NULL;
    Slot *seen = NULL;
    if (!PyArg_ParseTuple(args, "y*nnn", &view, &i_name, &i_type, &i_core)) return NULL;
    cp p = (cp)view.buf, e = p + view.len;
    Py_ssize_t width = i_name > i_type ? i_name : i_type, rows = 0, used = 0;
    if (i_core > width) width = i_core;
    if (!utf8_ok(p, e) || memchr(p, 0, (size_t)view.len)) goto bail;
    if (!(types = PyDict_New()) || !(cores = PyDict_New())) goto out;
    size_t slots = 1 << 16;
    if (!(seen = PyMem_Calloc(slots, sizeof(Slot)))) {
        PyErr_NoMemory();
        goto out;
    }
    for (size_t k = 0; k < slots; k++) seen[k].id = -1;
    while (p < e) { /* one record */
        Span f[3] = {{NULL, NULL}, {NULL, NULL}, {NULL, NULL}};
        Py_ssize_t col = 0;
        rows++;
        if (*p == '\n' || *p == '\r') { /* an empty line: csv yields [] */
            if (*p == '\r' && (p + 1 >= e || p[1] != '\n')) goto bail;
            p += *p == '\r' ? 2 : 1;
            continue;
        }
        for (;;) { /* one field */
            cp a, b;
            if (p < e && *p == '"') {
                a = ++p;
                for (;;) {
                    cp q = memchr(p, '"', (size_t)(e - p));
                    if (!q) goto bail; /* unclosed at the end of the file */
                    if (q + 1 < e && q[1] == '"') {
                        if (col == i_name || col == i_type || col == i_core) goto bail;
                        p = q + 2;
                        continue;
                    }
                    b = q;
                    p = q + 1;
                    break;
                }
                if (p < e && *p != ',' && *p != '\n' && *p != '\r') goto bail;
            } else {
                a = p;
                while (p < e && *p != ',' && *p != '\n' && *p != '\r') {
                    if (*p == '"') goto bail;
                    p++;
                }
                b = p;
            }
            if (col == i_name) f[0] = (Span){a, b};
            if (col == i_type) f[1] = (Span){a, b};
            if (col == i_core) f[2] = (Span){a, b};
            col++;
            if (p < e && *p == ',') {
                p++;
                continue;
            }
            break; /* a line end or the end of the data */
        }
        if (p < e) {
            if (*p == '\r') {
                if (p + 1 >= e || p[1] != '\n') goto bail;
                p += 2;
            } else {
                p++;
            }
        }
        if (col <= width) continue; /* too short: the loader skips it */
        Py_ssize_t n = f[0].b - f[0].a;
        uint64_t h = fnv1a(f[0].a, n);
        size_t k = (size_t)h & (slots - 1);
        int known = 0;
        while (seen[k].id >= 0) {
            if (seen[k].hash == h && seen[k].len == n && memcmp(seen[k].p, f[0].a, (size_t)n) == 0) {
                known = 1;
                break;
            }
            k = (k + 1) & (slots - 1);
        }
        if (known) continue;
        if ((size_t)used >= slots / 2 || n > INT32_MAX) goto bail; /* a table this large: the csv module reads it */
        seen[k] = (Slot){h, f[0].a, (int32_t)n, 0};
        used++;
        PyObject *name = PyUnicode_DecodeUTF8((const char *)f[0].a, n, NULL);
        PyObject *ty = name ? PyUnicode_DecodeUTF8((const char *)f[1].a, f[1].b - f[1].a, NULL) : NULL;
        PyObject *co = ty ? PyUnicode_DecodeUTF8((const char *)f[2].a, f[2].b - f[2].a, NULL) : NULL;
        int rc = co ? PyDict_SetItem(types, name, ty) | PyDict_SetItem(cores, name, co) : -1;
        Py_XDECREF(name);
        Py_XDECREF(ty);
        Py_XDECREF(co);
        if (rc < 0) goto out;
    }
    result = Py_BuildValue("(OOn)", types, cores, rows);
    goto out;
bail:
    result = Py_NewRef(Py_None);
out:
    PyMem_Free(seen);
    Py_XDECREF(types);
    Py_XDECREF(cores);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS, "One slice of a trace event array as columns, or None (see the module source)."},
    {"kernel_names", kernel_names, METH_VARARGS, "kernel_details.csv rows: (types, cores, rows) or None (see above)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_scan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__scan(void) { return PyModule_Create(&module); }
