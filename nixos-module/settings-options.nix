# Option types for `services.mdclaw.settings`, derived from config-schema.json.
#
# config-schema.json is generated from mdclaw's pydantic models (`mdclaw config-schema --json`)
# and a test keeps it current, so every key mdclaw accepts is a typed NixOS option here with
# mdclaw's own description: a misspelt key or a value of the wrong type fails at evaluation,
# before anything is built. What JSON Schema cannot say (exactly one main group, a timezone
# that exists, ...) is checked by `mdclaw check-config` when the config file is built.
#
# Keys the user leaves unset are null here and left out of config.yaml, so mdclaw's own
# defaults apply; each option's description states that default.
{ lib, settingsFormat }:
let
  inherit (lib) types mkOption;

  schema = lib.importJSON ./config-schema.json;

  refName = node: lib.last (lib.splitString "/" node."$ref");
  resolve = node: if node ? "$ref" then schema."$defs".${refName node} else node;

  # The one non-null alternative of an `anyOf [X, null]`, or null if the node is not one.
  optionalOf =
    node:
    let
      alts = builtins.filter (a: (a.type or null) != "null") (node.anyOf or [ ]);
    in
    if node ? anyOf && builtins.length alts == 1 && builtins.length node.anyOf == 2 then
      builtins.head alts
    else
      null;

  # pydantic patterns are Python regexes anchored at the start; builtins.match wants a POSIX
  # extended regex matching the whole string. Translate the escapes mdclaw's patterns use.
  toEre =
    pattern:
    let
      classes = {
        d = "[:digit:]";
        s = "[:space:]";
        w = "[:alnum:]_";
      };
      step =
        st: c:
        if st.esc then
          st
          // {
            esc = false;
            out =
              st.out
              + (
                if classes ? ${c} then
                  (if st.bracket then classes.${c} else "[${classes.${c}}]")
                else if st.bracket then
                  c
                else
                  "\\" + c
              );
          }
        else if c == "\\" then
          st // { esc = true; }
        else if c == "[" && !st.bracket then
          st
          // {
            bracket = true;
            out = st.out + c;
          }
        else if c == "]" && st.bracket then
          st
          // {
            bracket = false;
            out = st.out + c;
          }
        else
          st // { out = st.out + c; };
      body =
        (builtins.foldl' step {
          out = "";
          esc = false;
          bracket = false;
        } (lib.stringToCharacters pattern)).out;
      start = if lib.hasPrefix "^" body then lib.removePrefix "^" body else ".*" + body;
      whole =
        if lib.hasSuffix "$" start && !lib.hasSuffix "\\$" start then
          lib.removeSuffix "$" start
        else
          start + ".*";
    in
    whole;

  withDescription = description: type: type // { inherit description; };

  # mdclaw reads "90s", "10m", "1h", "2d", "500ms" or an integer of milliseconds.
  durationType = types.either types.ints.positive (
    withDescription "duration such as \"90s\", \"10m\", \"1h\" or milliseconds" (
      types.strMatching "[[:space:]]*[0-9]+(\\.[0-9]+)?[[:space:]]*(ms|s|m|h|d)?[[:space:]]*"
    )
  );

  # Secrets are read from files at run time; a path in the Nix store would be world-readable.
  secretFileType =
    withDescription "path of a file outside the Nix store (string; $VARIABLES are expanded)"
      (types.addCheck types.str (s: !lib.hasPrefix "${builtins.storeDir}/" s && s != ""));

  stringType =
    key: node:
    if lib.hasSuffix "_file" key then
      secretFileType
    else if key == "data_dir" then
      withDescription "absolute path" (types.strMatching "/.*")
    else if node ? pattern && !lib.hasInfix "(?" node.pattern then
      types.strMatching (toEre node.pattern)
    else if (node.minLength or 0) > 0 || (node.maxLength or null) != null then
      withDescription (
        if node ? maxLength then
          "string of ${toString (node.minLength or 0)} to ${toString node.maxLength} characters"
        else
          "non-empty string"
      ) (
        types.addCheck types.str (
          s:
          builtins.stringLength s >= (node.minLength or 0)
          && (!(node ? maxLength) || builtins.stringLength s <= node.maxLength)
        )
      )
    else
      types.str;

  numberType =
    base: baseName: node:
    let
      checks = lib.filter (c: c.on) [
        {
          on = node ? minimum;
          text = ">= ${toString (node.minimum or 0)}";
          ok = x: x >= node.minimum;
        }
        {
          on = node ? exclusiveMinimum;
          text = "> ${toString (node.exclusiveMinimum or 0)}";
          ok = x: x > node.exclusiveMinimum;
        }
        {
          on = node ? maximum;
          text = "<= ${toString (node.maximum or 0)}";
          ok = x: x <= node.maximum;
        }
      ];
    in
    if checks == [ ] then
      base
    else
      withDescription "${baseName} ${lib.concatMapStringsSep " and " (c: c.text) checks}" (
        types.addCheck base (x: lib.all (c: c.ok x) checks)
      );

  # The NixOS type for one schema node; `key` is the config key it sits under.
  typeOf =
    key: node:
    let
      inner = optionalOf node;
      n = resolve node;
      t = n.type or null;
    in
    if inner != null then
      types.nullOr (typeOf key inner)
    else if n ? properties then
      submoduleOf n
    else if n ? enum then
      types.enum n.enum
    else if (n.format or null) == "duration" then
      durationType
    else if t == "string" then
      stringType key n
    else if t == "integer" then
      numberType types.int "integer" n
    else if t == "number" then
      numberType types.number "number" n
    else if t == "boolean" then
      types.bool
    else if t == "array" then
      types.listOf (typeOf key (n.items or { }))
    else if t == "object" && builtins.isAttrs (n.additionalProperties or null) then
      types.attrsOf (typeOf key n.additionalProperties)
    else
      settingsFormat.type;

  isCollection =
    node:
    let
      n = resolve node;
    in
    optionalOf node == null && (n ? properties || (n.type or null) == "object" || (n.type or null) == "array");

  emptyOf = node: if ((resolve node).type or null) == "array" then [ ] else { };

  showDefault =
    node:
    if (node.default or null) == null || node.default == [ ] || node.default == { } then
      ""
    else
      " When unset (null), mdclaw uses `${builtins.toJSON node.default}`.";

  optionFor =
    required: key: node:
    let
      description =
        (node.description or "")
        + lib.optionalString (!required && !isCollection node) (showDefault node);
    in
    if required then
      mkOption {
        type = typeOf key node;
        inherit description;
      }
    else if isCollection node then
      mkOption {
        type = typeOf key node;
        default = emptyOf node;
        inherit description;
      }
    else
      mkOption {
        # Already `nullOr` when the schema allows null.
        type = if optionalOf node != null then typeOf key node else types.nullOr (typeOf key node);
        default = null;
        inherit description;
      };

  # Every pydantic model forbids unknown keys, so the submodules have no freeform part.
  submoduleOf =
    node:
    types.submodule {
      options = lib.mapAttrs (
        key: prop: optionFor (builtins.elem key (node.required or [ ])) key prop
      ) node.properties;
    };
in
{
  inherit schema toEre;
  # The type of `services.mdclaw.settings`: the whole config.yaml.
  type = submoduleOf schema;
  description = schema.description;
}
